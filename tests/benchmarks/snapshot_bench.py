"""In-memory snapshot benchmark: prints two ratios (a 2-node LocalCluster, keepers on both nodes).

(1) snapshot cost: tokens/s of the engine's Trainer with an in-memory snapshot after EVERY step
    (SnapshotClient with the optimizer hook: host copy beside the next forward/backward, sent to
    the keepers on both nodes in the background, committed by a supervisor-like thread) over tokens/s
    with no snapshot. Steps alternate in blocks (none/snap, then snap/none) so load from other work
    on a shared machine falls on both; the figure is the median over adjacent block pairs of their
    time ratio (all-step medians and the fastest steps printed too). Goal >= 0.97.
    The figure is wall-clock on THIS machine, where the background put, the cross-"node" transfer
    and both keepers' copies share 2 cores with training (and other work); the training thread's own
    CPU time ratio is printed too.
(4) restore: time to find and load the newest committed snapshot from the keepers
    (restore_from_keepers) over the time to find and load the newest checkpoint of the same state
    from S3 (a local SeaweedFS, CheckpointManager.load_latest with checksum verification). Lower is
    better.

Run: .venv/bin/python -m tests.benchmarks.snapshot_bench [--preset debug] [--blocks 6] [--per-block 4]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from checkpointing.config import CheckpointConfig  # noqa: E402
from checkpointing.keepers import commit_snapshot, ensure_keepers, kill_keepers, memory_reports  # noqa: E402
from checkpointing.local_s3 import LocalS3Server  # noqa: E402
from checkpointing.persistent import CheckpointManager  # noqa: E402
from checkpointing.snapshot import SnapshotClient, SnapshotResult, restore_from_keepers  # noqa: E402
from parallel.config import EngineConfig  # noqa: E402
from parallel.trainer import Trainer  # noqa: E402
from service.local_cluster import LocalCluster  # noqa: E402

JOB = "snapshot-bench"


def engine_cfg(preset: str, seed: int = 0) -> EngineConfig:
    return EngineConfig.model_validate({
        "model": {"preset": preset, "init_seed": seed},
        "training": {"steps": 10_000, "seq_len": 128, "global_batch_size": 8, "warmup_steps": 2},
    })  # fmt: skip


class Committer:
    """What the supervisor does: commit each snapshot once its shard is held twice."""

    def __init__(self, keepers: dict[str, Any]) -> None:
        self.keepers = keepers
        self.q: queue.Queue[SnapshotResult | None] = queue.Queue()
        self.results: list[SnapshotResult] = []
        self.failed: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (res := self.q.get()) is not None:
            self.results.append(res)
            if not res.ok:
                self.failed.append(f"step {res.step}: {res.errors}")
            elif not commit_snapshot(self.keepers, JOB, res.generation, res.step, 1):
                self.failed.append(f"step {res.step}: not committed")

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()


def throughput(keepers: dict[str, Any], preset: str, blocks: int, per_block: int) -> tuple[Trainer, float]:
    torch.set_num_threads(1)
    trainer = Trainer(engine_cfg(preset), device=torch.device("cpu"))
    client = SnapshotClient(JOB, 0, 1, "head", keepers, optimizer=trainer.optimizer)
    committer = Committer(keepers)
    times: dict[str, list[float]] = {"none": [], "snap": []}
    cpu: dict[str, list[float]] = {"none": [], "snap": []}  # the training thread's own CPU time
    sd_times: list[float] = []  # trainer.state_dict() (get_state_dict), part of the snapshot steps
    pair_ratios: list[float] = []  # per adjacent none/snap block pair: they share the machine's load

    def step(mode: str, last_of_block: bool) -> float:
        t0, c0 = time.perf_counter(), time.thread_time()
        trainer.train_step()
        if mode == "snap":
            t1 = time.perf_counter()
            state = trainer.state_dict()
            sd_times.append(time.perf_counter() - t1)
            h = client.snapshot(state, trainer.step, generation=0)
            h.add_done_callback(committer.q.put)
            if last_of_block:
                client.wait_copies()  # charge this block's copy to it, not to the next block
        cpu[mode].append(time.thread_time() - c0)
        return time.perf_counter() - t0

    for mode in ("none", "snap"):  # warm-up: first steps, layout, buffers, keepers' first shard
        for i in range(2):
            step(mode, i == 1)
    for b in range(blocks):
        block: dict[str, float] = {}
        for mode in ("none", "snap") if b % 2 == 0 else ("snap", "none"):
            ts = [step(mode, i == per_block - 1) for i in range(per_block)]
            times[mode] += ts
            block[mode] = sum(ts)
        pair_ratios.append(block["none"] / block["snap"])
    client.close()
    committer.close()
    tokens = trainer.data.tokens_per_step()
    med = {m: statistics.median(t) for m, t in times.items()}
    mean = {m: statistics.fmean(t) for m, t in times.items()}
    ratio = statistics.median(pair_ratios)
    res = committer.results[-1]
    nbytes = res.nbytes
    blocking = statistics.median(r.blocking_s for r in committer.results)
    send = statistics.median(r.send_s for r in committer.results)
    print(f"model {preset}: {nbytes / 2**20:.1f} MiB snapshot per step, {tokens} tokens per step, "
          f"{len(times['snap'])} steps per mode")  # fmt: skip
    print(f"  no snapshot      {tokens / med['none']:9.0f} tokens/s (median step {med['none'] * 1e3:.1f} ms, "
          f"mean {mean['none'] * 1e3:.1f} ms)")  # fmt: skip
    print(f"  snapshot/step    {tokens / med['snap']:9.0f} tokens/s (median step {med['snap'] * 1e3:.1f} ms, "
          f"mean {mean['snap'] * 1e3:.1f} ms)")  # fmt: skip
    print(f"  trainer.state_dict() {statistics.median(sd_times) * 1e3:.1f} ms median; "
          f"snapshot call {blocking * 1e3:.1f} ms median; optimizer waited {client.copy_wait_s * 1e3:.0f} ms "
          f"in all for copies; background send+acks {send * 1e3:.1f} ms median")  # fmt: skip
    cpu_ratio = statistics.median(cpu["none"]) / statistics.median(cpu["snap"])
    print(f"  training thread's own CPU time per step: none {statistics.median(cpu['none']) * 1e3:.1f} ms, "
          f"snapshot {statistics.median(cpu['snap']) * 1e3:.1f} ms -> ratio {cpu_ratio:.3f} (what the step pays "
          f"where the copies, sends and keepers have cores of their own, as beside a GPU)")  # fmt: skip
    if committer.failed:
        print(f"  NOT COMMITTED: {committer.failed[:3]}")
    print(f"  per block pair: {' '.join(f'{r:.3f}' for r in pair_ratios)}; fastest steps: "
          f"{min(times['none']) / min(times['snap']):.3f}")  # fmt: skip
    print(f"(1) snapshot every step / none, tokens/s: {ratio:.3f} (median of {len(pair_ratios)} adjacent block "
          f"pairs; medians of all steps {med['none'] / med['snap']:.3f}); goal >= 0.97")  # fmt: skip
    return trainer, ratio


def restore_vs_s3(
    keepers: dict[str, Any], trainer: Trainer, preset: str, workdir: Path, rounds: int
) -> float:
    server = LocalS3Server(workdir / "seaweedfs")
    try:
        server.start()
        server.create_bucket("snapshot-bench")
        cfg = CheckpointConfig(uri="s3://snapshot-bench/run", s3=server.s3_config())
        mgr = CheckpointManager(cfg, "unused", rank=0, world_size=1)
        res = mgr.save(trainer.state_dict(), trainer.step, generation=0, layout={})
        assert res.ok, res.error
        fresh = Trainer(engine_cfg(preset, seed=7), device=torch.device("cpu"))
        state = fresh.state_dict()
        t_keep: list[float] = []
        t_s3: list[float] = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            info = restore_from_keepers(keepers, JOB, state, prefer_node="head")
            t_keep.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ckpt = mgr.load_latest(state)
            t_s3.append(time.perf_counter() - t0)
            assert ckpt is not None and ckpt.step == trainer.step
        mgr.close()
    finally:
        server.stop()
    k, s = min(t_keep), min(t_s3)
    print(f"restore of step {info.step} ({res.bytes_written / 2**20:.1f} MiB): keepers {k * 1e3:.0f} ms "
          f"(median {statistics.median(t_keep) * 1e3:.0f}), S3 {s * 1e3:.0f} ms "
          f"(median {statistics.median(t_s3) * 1e3:.0f}), best of {rounds}")  # fmt: skip
    print(f"(4) restore from keepers / restore from S3, time: {k / s:.3f} (lower is better)")
    return k / s


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="debug", help="model preset (tiny, debug, small, ...)")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--per-block", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="restore rounds (best of)")
    args = ap.parse_args(argv if argv is not None else [])
    with (
        tempfile.TemporaryDirectory(prefix="snapbench-") as tmp,
        LocalCluster(head_cpus=1, fast_failure_detection=False) as cluster,
    ):
        cluster.add_node("b", num_cpus=1)
        cluster.connect()
        keepers = ensure_keepers(["head", "b"], memory_limit_mb=4096)
        try:
            trainer, _ = throughput(keepers, args.preset, args.blocks, args.per_block)
            used = {n: r["used_bytes"] // 2**20 for n, r in memory_reports(keepers).items()}
            print(f"  keeper memory after the run (MiB, last two committed kept): {used}")
            restore_vs_s3(keepers, trainer, args.preset, Path(tmp), args.rounds)
        finally:
            kill_keepers(keepers)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
