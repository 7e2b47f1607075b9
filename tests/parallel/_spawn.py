"""Run a function on N gloo ranks (spawned processes) and collect each rank's return value.

Used by the PP/CP/EP tests. The function must be importable (module level). Each rank gets
`(rank, world, *args)` with the default process group initialised; the return value is pickled
back. A rank's exception fails the test with that rank's traceback.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from workers.ports import free_port


def init_group(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    """(Re)form the default group on a fresh port: layouts can be batched in one launch."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Any
    try:
        init_group(rank, world, port)
        result = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    if dist.is_initialized():
        # Every rank done with the group before any tears it down (rank 0 hosts the TCPStore). A rank of
        # test_local_clip once died by SIGABRT, "terminate called without an active exception": a C++ thread
        # destroyed while joinable, as in a teardown racing a peer; where exactly was not caught. The result
        # is written first, and a failed barrier (a peer that raised) is not this rank's error.
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` ranks; returns the results in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _entry, args=(world, free_port(), out_dir, fn, args), nprocs=world, join=True, start_method="spawn"
        )
        results = [pickle.loads(Path(out_dir, f"{r}.pkl").read_bytes()) for r in range(world)]
    errors = [f"rank {r}:\n{res[1]}" for r, res in enumerate(results) if res[0] == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [res[1] for res in results]
