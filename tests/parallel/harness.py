"""A small multi-process harness: start N ranks once, run many layouts in them.

`launch("tests.parallel.rank_fns:fn", world, payload)` starts `world` processes (forked from a
fork server that has imported torch once); each calls
`fn(ctx, payload)` and the harness returns every rank's return value (or raises with the
failing rank's traceback). Inside, `ctx.in_group(world, tag, body)` forms a process group of
the first `world` ranks on a fresh TCPStore (rank 0 picks a free port and publishes it through
the launch's control store), runs `body()`, and destroys the group -- so one launch can run
layouts of several sizes in sequence, as elastic re-forming does in the same processes.
Ranks are stopped by PID if anything goes wrong.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

HOST = "127.0.0.1"


class RankContext:
    def __init__(self, rank: int, world: int, control_port: int) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.world = world
        self.control = dist.TCPStore(HOST, control_port, world + 1, is_master=False, timeout=timedelta(seconds=120))

    def in_group(self, world: int, tag: str, body: Callable[[], Any]) -> Any:
        """Run body() in a fresh process group of ranks 0..world-1; others return None at once."""
        from parallel import dist as pdist

        if self.rank >= world:
            return None
        store = None
        if self.rank == 0:
            store = pdist.make_store(HOST, 0, world, is_master=True)
            self.control.set(f"port/{tag}", str(store.port))
        else:
            port = int(self.control.get(f"port/{tag}").decode())
            store = pdist.make_store(HOST, port, world, is_master=False)
        pdist.init_process_group(self.rank, world, store, device="cpu", timeout_s=120)
        try:
            return body()
        finally:
            pdist.destroy_process_group()
            # Rank 0 hosts the store: it waits until every rank has left the group.
            self.control.add(f"done/{tag}", 1)
            if self.rank == 0:
                self._wait_count(f"done/{tag}", world)
            del store

    def _wait_count(self, key: str, n: int) -> None:
        import time

        while int(self.control.add(key, 0)) < n:
            time.sleep(0.01)

    def barrier(self, tag: str) -> None:
        """All launched ranks meet (outside any process group)."""
        self.control.add(f"barrier/{tag}", 1)
        self._wait_count(f"barrier/{tag}", self.world)


def _rank_main(target: str, rank: int, world: int, control_port: int, payload: Any, out: mp.Queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch

        torch.set_num_threads(1)
        module, fn = target.split(":")
        ctx = RankContext(rank, world, control_port)
        result = getattr(importlib.import_module(module), fn)(ctx, payload)
        # Plain pickle: torch's queue pickler shares tensors by fd, which dies with the rank.
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:  # report everything, including DCP's BaseException subclasses
        out.put((rank, False, traceback.format_exc()))


def _context() -> mp.context.BaseContext:
    """A fork server that has imported torch and the engine once: each rank then starts in well
    under a second instead of re-importing torch (seconds each, far more on a loaded machine).
    It forks from a process that has started no threads, so it is as safe as spawn here."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "parallel.trainer"])
    return ctx


def _others(procs: list[Any], out: Any, first: int) -> str:
    """The other ranks' fate when one failed: a peer that died without a word (a crash) shows here by
    its exit code; one that failed too, by its own error's last line."""
    time.sleep(2)
    errs: dict[int, str] = {}
    with contextlib.suppress(queue.Empty):
        while True:
            rank, ok, value = out.get(timeout=0.5)
            if not ok:
                errs[rank] = str(value).strip().splitlines()[-1][:300]
    lines = [f"rank {r}: " + (errs.get(r) or (f"exit code {p.exitcode}" if p.exitcode is not None else "running"))
             for r, p in enumerate(procs) if r != first]
    return "\nother ranks:\n" + "\n".join(lines)


def launch(target: str, world: int, payload: Any = None, timeout_s: float = 300.0) -> list[Any]:
    """Run `target` ("module:function") on `world` ranks; returns results ordered by rank."""
    import torch.distributed as dist

    control = dist.TCPStore(HOST, 0, world + 1, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=timeout_s))
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before the fork server starts: ranks inherit it
    ctx = _context()
    out: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(target, r, world, control.port, payload, out), daemon=True)
        for r in range(world)
    ]
    results: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        while len(results) < world:
            try:
                rank, ok, value = out.get(timeout=timeout_s)
            except queue.Empty as exc:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} gave no result "
                                   f"within {timeout_s}s") from exc
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}{_others(procs, out, rank)}")
            results[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=30)
        return [results[r] for r in range(world)]
    finally:
        for p in procs:  # only our own children, by PID
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        del control
