"""The DeviceMesh a (re-)formed group builds: ParallelDims.build_mesh against the mesh of every named dim.

Each generation of a job builds its mesh again (a fresh Trainer, or `parallel.regroup.attach` for a
kept one), on the critical path of every recovery, swap and grow-back. torch makes a process group for
each group of each mesh dim; with gloo each `new_group` is a store barrier over every rank. The
baseline is the rule build_mesh had until 2026-12-08: all five dims (pp, dp_replicate, dp_shard, cp,
tp), size-1 ones included, and the three flattened sub-meshes; now only dims of size > 1 are built.

W gloo ranks (separate processes, one TCPStore, as a group's ranks are) build both, interleaved, R
rounds; a round's time is its slowest rank's (a re-form waits for it). Layout: 1-D FSDP (the demo's).
Run: python -m tests.benchmarks.mesh_bench [--worlds 3 4] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _every_dim_mesh(world: int) -> Any:
    """The baseline: the old rule, every named dim built, size 1 or not."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1, world, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    mesh[("dp_replicate", "dp_shard", "cp")]._flatten("dp_cp")
    return mesh


def _rank(rank: int, world: int, port: int, rounds: int, out: Any) -> None:
    import torch.distributed as dist

    from parallel.dims import ParallelDims

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    times: dict[str, list[float]] = {"every dim": [], "build_mesh": []}
    for r in range(rounds + 1):  # round 0 warms torch's imports and caches: not counted
        order = ("every dim", "build_mesh") if r % 2 else ("build_mesh", "every dim")
        for arm in order:
            dist.barrier()
            t0 = time.perf_counter()
            if arm == "every dim":
                _every_dim_mesh(world)
            else:
                ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=world).build_mesh("cpu")
            if r:
                times[arm].append(time.perf_counter() - t0)
    out.put((rank, times))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, rounds: int) -> dict[str, list[float]]:
    """Per round, the slowest rank's seconds for each arm."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, rounds, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        per_rank = [q.get(timeout=300)[1] for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {arm: [max(t[arm][i] for t in per_rank) for i in range(rounds)] for arm in per_rank[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args(argv if argv is not None else [])
    print(f"{'world':>5}  {'every dim ms (median, max)':>27}  {'build_mesh ms (median, max)':>28}  ratio")
    for world in a.worlds:
        t = measure(world, a.rounds)
        old, new = (statistics.median(t[k]) * 1e3 for k in ("every dim", "build_mesh"))
        print(f"{world:>5}  {old:>18.1f} {max(t['every dim']) * 1e3:>8.1f}  {new:>19.1f} {max(t['build_mesh']) * 1e3:>8.1f}"
              f"  {new / old:.3f}", flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
