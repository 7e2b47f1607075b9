"""Rank functions of the NCCL tests (spawned processes; module level so they pickle)."""

from __future__ import annotations

import os
import pickle
import time
import traceback
from pathlib import Path
from typing import Any


def _join(gen: int, rank: int, world: int, port: int, timeout_s: float) -> None:
    import torch

    from parallel import dist as pdist
    from workers.group import join_group

    store = None
    if rank == 0:
        store = pdist.make_store("127.0.0.1", port, world, is_master=True, timeout_s=60)
    join_group(gen, rank, world, "127.0.0.1", port, device=torch.device("cuda", rank % torch.cuda.device_count()),
               timeout_s=timeout_s, master_store=store)


def _all_reduce_ok(world: int) -> bool:
    import torch
    import torch.distributed as dist

    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return bool(torch.all(t == world))


def abort_and_reform(rank: int, world: int, ports: list[int], out: str) -> None:
    """Generation 0 at world 2: rank 1 dies; rank 0's all_reduce fails (peer error or its abort), it
    aborts and leaves; generation 1 re-forms at world 1 in the same process and all_reduce works.
    Then generation 2: rank 0 blocks in a collective its live peer never joins; abort_if_stuck
    returns it long before the 120 s timeout."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {}
    try:
        import torch
        import torch.distributed as dist

        from workers.group import abort_if_stuck, leave_group, uses_nccl

        _join(0, rank, 2, ports[0], timeout_s=10)
        result["nccl"] = uses_nccl()
        result["env"] = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        result["gen0_ok"] = _all_reduce_ok(2)
        if rank == 1:
            os._exit(0)  # a worker that vanishes
        t0 = time.monotonic()
        try:
            abort_if_stuck(lambda: False, grace_s=2.0)  # the supervisor's abort reaches a blocked rank
            t = torch.ones(4, device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            result["gen0_error"] = None
        except Exception as e:  # noqa: BLE001 - expected: the peer is gone
            result["gen0_error"] = f"{type(e).__name__}: {e}"[:300]
        result["gen0_unblocked_s"] = time.monotonic() - t0
        leave_group(abort=True)
        result["left"] = not dist.is_initialized()
        _join(1, 0, 1, ports[1], timeout_s=10)
        result["gen1_ok"] = _all_reduce_ok(1)
        leave_group()
    except BaseException:
        result["traceback"] = traceback.format_exc()
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
