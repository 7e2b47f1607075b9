"""Engine throughput and the local launcher's overhead, as ratios measured in one run.

- tokens/s of the same tiny model at 1 process, FSDP 2 and FSDP 4 (through the launcher);
- the launcher's overhead: the same Trainer in a bare in-process loop (single process) against
  the same job through the launcher with --nproc 1: steady-state tokens/s and end-to-end wall.

Steady-state tokens/s is the median over the steps after the first WARMUP (start-up excluded).
The configurations run interleaved, ROUNDS times, and each keeps its best round: on a small
shared CPU machine other processes slow any one round down. The ratios are what to compare.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

STEPS = 30
WARMUP = 5
ROUNDS = 2


def _job() -> dict:
    return {
        "model": {"preset": "tiny"},
        "training": {"steps": STEPS, "seq_len": 64, "global_batch_size": 16, "warmup_steps": 2},
        "parallelism": {"dp_shard": -1},
    }


def _steady(tokens_per_s: list[float]) -> float:
    return statistics.median(tokens_per_s[WARMUP:])


def in_process() -> tuple[float, float]:
    """(steady tokens/s, wall s from nothing built to the last step) of a bare loop in this process."""
    import torch

    from parallel.config import EngineConfig
    from parallel.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launcher's ranks (OMP_NUM_THREADS=1)
    try:
        t0 = time.perf_counter()
        trainer = Trainer(EngineConfig.model_validate(_job()), device=torch.device("cpu"))
        tps = [trainer.train_step().tokens_per_s for _ in range(STEPS)]
        wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return _steady(tps), wall


def launched(nproc: int, out: Path) -> tuple[float, float, float]:
    """(steady tokens/s, wall s including process start-up, rank 0 start-up s) through the launcher."""
    from parallel.config import EngineConfig
    from workers.launcher import run_local
    from workers.metrics_log import read_metrics

    result = run_local(EngineConfig.model_validate(_job()), nproc, out, device="cpu", show_progress=False)
    tps = [line["tokens_per_s"] for line in read_metrics(result.metrics_path)]
    return _steady(tps), result.wall_s, result.setup_s or float("nan")


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"tiny model, {STEPS} steps of 16x64 tokens, CPU, {os.cpu_count()} cores; "
          f"steady = median tokens/s after step {WARMUP}; best of {ROUNDS} interleaved rounds")
    best: dict[str, tuple[float, float, float | None]] = {}

    def keep(label: str, tps: float, wall: float, setup: float | None) -> None:
        prev = best.get(label)
        best[label] = (tps, wall, setup) if prev is None else (
            max(prev[0], tps), min(prev[1], wall), None if setup is None else min(prev[2] or setup, setup)
        )

    with tempfile.TemporaryDirectory(prefix="engine_bench_") as tmp:
        for _ in range(ROUNDS):
            keep("in-process loop, 1 process", *in_process(), None)
            for nproc in (1, 2, 4):
                tps, wall, setup = launched(nproc, Path(tmp) / f"n{nproc}")
                keep("launcher, 1 process" if nproc == 1 else f"launcher, FSDP {nproc}", tps, wall, setup)
    rows = [(label, *v) for label, v in best.items()]
    base_tps, base_wall = rows[0][1], rows[0][2]
    one = rows[1][1]
    print(f"{'run':<28}{'tokens/s':>12}{'vs 1 proc':>11}{'wall s':>9}{'start-up s':>12}")
    for label, tps, wall, setup in rows:
        setup_txt = f"{setup:.1f}" if setup is not None else "-"
        print(f"{label:<28}{tps:>12,.0f}{tps / one:>10.2f}x{wall:>9.1f}{setup_txt:>12}")
    print(
        f"launcher overhead (1 process): steady tokens/s {one / base_tps:.2f}x the in-process loop; "
        f"end-to-end wall {rows[1][2] / base_wall:.2f}x (start-up: interpreter, imports, group)"
    )


if __name__ == "__main__":
    main()
