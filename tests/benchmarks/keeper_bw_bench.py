"""Keeper bandwidth: how fast a shard goes to a keeper on another node and comes back (docs/scale.md's
restore term). A 2-node LocalCluster on this machine (two raylets, so a real object transfer between
their object stores); the driver on the head puts a shard into `keeper-b` (put_shard: Ray's transfer
and the keeper's copy into its own heap) and reads it back (get_blob: the keeper's put and the
transfer). Against a plain in-process copy of the same bytes (numpy), the ceiling of this machine.
Run: python -m tests.benchmarks.keeper_bw_bench [MiB]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

from checkpointing.keepers import ensure_keepers, kill_keepers  # noqa: E402
from service.local_cluster import LocalCluster  # noqa: E402


def measure(mib: int = 256, rounds: int = 3) -> dict[str, float]:
    nbytes = mib * 2**20
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    copies = []
    out = np.ones_like(data)  # touched: the copy below measures memory bandwidth, not page faults
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(out, data)
        copies.append(time.perf_counter() - t0)
    del out
    with LocalCluster(head_cpus=1, fast_failure_detection=False, object_store_mb=4 * mib + 256) as cluster:
        cluster.add_node("b", num_cpus=1)
        cluster.connect()
        keepers = ensure_keepers(["b"], memory_limit_mb=4 * mib + 64)
        k = keepers["b"]
        try:
            puts, gets = [], []
            for step in range(rounds):
                t0 = time.perf_counter()
                ray.get(k.put_shard.remote("bw", 0, step, 0, 1, b"", b"", data), timeout=300)
                puts.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                blob = ray.get(ray.get(k.get_blob.remote("bw", 0, step, 0), timeout=300)[0], timeout=300)
                gets.append(time.perf_counter() - t0)
                assert blob.nbytes == nbytes
                del blob
                ray.get(k.commit.remote("bw", 0, step))
            ray.get(k.drop_job.remote("bw"))
        finally:
            kill_keepers(keepers)
    gb = nbytes / 1e9
    return {"copy_gbs": gb / statistics.median(copies), "put_gbs": gb / statistics.median(puts),
            "get_gbs": gb / statistics.median(gets), "mib": mib}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    r = measure(int(args[0]) if args else 256)
    print(f"keeper bandwidth, {r['mib']} MiB shard, 2 raylets on this machine, median of 3: put (send + keeper copy) "
          f"{r['put_gbs']:.2f} GB/s, get (restore) {r['get_gbs']:.2f} GB/s; in-process copy {r['copy_gbs']:.2f} GB/s")
    print(f"keeper_bw: put_gbs={r['put_gbs']:.2f} get_gbs={r['get_gbs']:.2f} "
          f"get/copy={r['get_gbs'] / r['copy_gbs']:.2f}")


if __name__ == "__main__":
    main()
