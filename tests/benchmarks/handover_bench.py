"""The hand-over of one snapshot shard to the keeper on its own node, three ways, interleaved.

A real Keeper (in this process, its stream server on loopback) and a real ShardStream client send the
same shard N times each way, with a commit after each send so the keeper's retention frees old shards
as in a job:

- socket   the bytes over the keeper's TCP stream (how a shard reaches the other node's keeper)
- copy     the worker's shared-memory segment, copied out by the keeper (checkpoint.snapshot_shared_memory
           before keeping)
- keep     the keeper keeps the segment itself as the shard's bytes and hands it back once freed

Per way: wall time and CPU time (this process: client and keeper threads alike) per shard, and the
CPU against the socket's. The job-level cost of a snapshot (snapshot_job_bench) sits on top of this:
the staging copy, the copy to the other node, acks and commits.
Run: .venv/bin/python -m tests.benchmarks.handover_bench [--mib 35] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

from checkpointing import shm_segment
from checkpointing.keeper import Keeper
from checkpointing.shard_stream import ShardStream

WAYS = ("socket", "copy", "keep")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=35, help="shard size (the small preset's per rank on 2 ranks)")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args([] if argv is None else argv)  # (run_all calls main())
    nbytes = args.mib * 2**20
    keeper = Keeper("n0", memory_limit_mb=12 * args.mib + 64)
    host, port, token = keeper.stream_address()
    stream = ShardStream((host, port), token, timeout_s=60)
    # The worker's buffers: a segment per kept shard in flight (the keeper retains 2 committed), as
    # SnapshotClient holds them; each written once, so no way pays the first-touch page faults.
    segs = [shm_segment.Segment.create(nbytes) for _ in range(6)]
    for s in segs:
        s.tensor.numpy()[:] = 1
    lent: set[str] = set()
    cost: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
    step = 0
    for _ in range(args.rounds):
        for way in WAYS:
            step += 1
            seg = next(s for s in segs if s.name not in lent)
            blob = memoryview(seg.tensor.numpy()).cast("B")
            header = {"job_id": "bench", "generation": 0, "step": step, "rank": 0, "world_size": 1}
            w0, c0 = time.perf_counter(), time.process_time()
            stream.send(header, b"", b"", blob, shm=None if way == "socket" else seg.name, keep=way == "keep")
            keeper.commit("bench", 0, step)
            cost[way].append((time.perf_counter() - w0, time.process_time() - c0))
            if way == "keep" and stream.kept:
                lent.add(seg.name)
            lent -= set(stream.released)
            stream.released.clear()
    stream.close()
    keeper._stream.close()
    base = statistics.median(c for _, c in cost["socket"])
    print(f"one {args.mib} MiB shard to its own node's keeper, {args.rounds} rounds interleaved (medians):")
    for way in WAYS:
        wall = statistics.median(w for w, _ in cost[way])
        cpu = statistics.median(c for _, c in cost[way])
        print(f"  {way:<7} wall {wall * 1e3:7.2f} ms  CPU {cpu * 1e3:7.2f} ms  CPU vs socket {cpu / base:5.2f}")
    print(f"hand-over CPU vs socket: copy {statistics.median(c for _, c in cost['copy']) / base:.2f}, "
          f"keep {statistics.median(c for _, c in cost['keep']) / base:.2f}")
    del segs


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
