"""The planner's predictions against what the local launcher measures on CPU.

Memory: the launcher reports rank 0's peak resident set (`peak_mem_bytes`, ru_maxrss). That is
what the OS gives a rank, so it is what decides whether ranks fit in RAM; tracemalloc would miss
it all (torch allocates tensors in C, outside Python's allocator). RSS includes the process's
baseline (Python, torch, gloo: the CPU preset's `framework_bytes`, taken from a `tiny` run whose
model is negligible) and pages malloc keeps after the forward's temporaries are freed (the
preset's `transient_slack`). Both are explicit terms of the estimate, shown by --explain.

Time: the median step time after two warm-up steps. Only the ranking of layouts is compared
(the CPU is shared, so absolute times vary from run to run).

    .venv/bin/python -m tests.benchmarks.planner_bench [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from parallel.config import EngineConfig
from parallel.planner.hardware import make_cluster
from parallel.planner.layout import layout_from_config
from parallel.planner.search import Candidate, evaluate

MiB = 2**20


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    job: dict[str, Any]


def job(preset: str | dict[str, Any], parallelism: dict[str, Any], *, steps: int = 5, seq_len: int = 256, batch: int = 16,
        **training: Any) -> dict[str, Any]:
    return {
        "model": {"preset": preset} if isinstance(preset, str) else preset,
        "training": {"steps": steps, "seq_len": seq_len, "global_batch_size": batch, "warmup_steps": 0,
                     "log_every": 1, **training},
        "parallelism": parallelism,
    }


# Memory: tiny (baseline-dominated) and small (activations ~ half the peak) under fsdp/tp layouts.
MEMORY_CASES = [
    Case("tiny fsdp2", 2, job("tiny", {"dp_shard": 2}, seq_len=64, batch=8)),
    Case("tiny tp2", 2, job("tiny", {"tp": 2, "dp_shard": 1}, seq_len=64, batch=8)),
    Case("small fsdp2", 2, job("small", {"dp_shard": 2})),
    Case("small tp2", 2, job("small", {"tp": 2, "dp_shard": 1})),
    Case("small ddp2", 2, job("small", {"dp_replicate": 2, "dp_shard": 1})),
    Case("small fsdp2 AC full", 2, job("small", {"dp_shard": 2}, activation_checkpointing="full")),
    Case("small fsdp4", 4, job("small", {"dp_shard": 4})),
    Case("small fsdp2 x tp2", 4, job("small", {"dp_shard": 2, "tp": 2})),
]
QUICK_MEMORY = ["tiny fsdp2", "small fsdp2"]
# Ranking: the same model, batch and world under three layouts (from the runs above). On gloo
# they differ mostly in communication: DDP all-reduces (gloo's fastest collective), FSDP
# all-gathers and reduce-scatters weights (gloo's slowest), TP+SP all-gathers activations per layer.
RANKED = ["small ddp2", "small fsdp2", "small tp2"]


def predict(case: Case) -> Candidate:
    cfg = EngineConfig.model_validate(case.job)
    cluster = make_cluster(case.nproc, "cpu")
    layout, reasons = layout_from_config(cfg.parallelism, cluster.world)
    assert layout is not None, reasons
    res = evaluate(cfg.model, cfg.training, layout, cluster)
    assert isinstance(res, Candidate), getattr(res, "reasons", res)
    return res


def measure(case: Case) -> dict[str, Any]:
    """Run the job with the local launcher; rank 0's peak RSS and its step times."""
    from workers.launcher import run_local
    from workers.metrics_log import read_metrics

    cfg = EngineConfig.model_validate(case.job)
    with tempfile.TemporaryDirectory(prefix="planner-bench-") as out:
        t0 = time.perf_counter()
        res = run_local(cfg, case.nproc, out, device="cpu", show_progress=False)
        wall = time.perf_counter() - t0
        lines = read_metrics(res.metrics_path)
    steps = [m["step_time_s"] for m in lines]
    return {
        "peak_bytes": max(int(m["peak_mem_bytes"]) for m in lines),
        "step_time_s": statistics.median(steps[2:] if len(steps) > 2 else steps),
        "step_times": steps, "wall_s": wall,
    }


def compare(case: Case) -> dict[str, Any]:
    pred = predict(case)
    meas = measure(case)
    return {
        "case": case.name, "nproc": case.nproc,
        "predicted_peak_bytes": pred.memory.peak, "measured_peak_bytes": meas["peak_bytes"],
        "memory_ratio": pred.memory.peak / meas["peak_bytes"],
        "predicted_step_s": pred.step_time, "measured_step_s": meas["step_time_s"],
        "measured_step_times": meas["step_times"], "wall_s": meas["wall_s"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two memory cases, no ranking")
    ap.add_argument("--cases", nargs="*", help="only these cases (by name)")
    ap.add_argument("--rank-reps", type=int, default=2, help="runs of each ranked layout")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    cases = [c for c in MEMORY_CASES if not args.quick or c.name in QUICK_MEMORY]
    if args.cases:
        cases = [c for c in cases if c.name in args.cases]
    rows = [compare(c) for c in cases]
    print(f"{'case':24s} {'ranks':>5s} {'predicted':>12s} {'measured':>12s} {'pred/meas':>9s}")
    for r in rows:
        print(f"{r['case']:24s} {r['nproc']:5d} {r['predicted_peak_bytes'] / MiB:9.0f} MiB "
              f"{r['measured_peak_bytes'] / MiB:9.0f} MiB {r['memory_ratio']:9.3f}")
    worst = max(abs(r["memory_ratio"] - 1) for r in rows)
    print(f"memory: worst |predicted/measured - 1| = {worst:.3f} (target <= 0.25)")
    result: dict[str, Any] = {"memory": rows, "memory_worst_error": worst}
    if not args.quick:
        ranks = [r for r in rows if r["case"] in RANKED]
        if len(ranks) < 2:
            ranks = []
        # More runs of the ranked layouts, interleaved, so a burst of load on the shared CPU
        # does not decide the order: the median over every post-warm-up step of every run.
        for _ in range(args.rank_reps - 1):
            for r in ranks:
                case = next(c for c in MEMORY_CASES if c.name == r["case"])
                r["measured_step_times"] += measure(case)["step_times"]
        for r in ranks:
            per_run = len(r["measured_step_times"]) // args.rank_reps
            kept = [x for i, x in enumerate(r["measured_step_times"]) if i % per_run >= 2]
            r["measured_step_s"] = statistics.median(kept)
        by_pred = [r["case"] for r in sorted(ranks, key=lambda r: r["predicted_step_s"])]
        by_meas = [r["case"] for r in sorted(ranks, key=lambda r: r["measured_step_s"])]
        print(f"{'case':24s} {'predicted step':>15s} {'measured step (median)':>23s}")
        for r in ranks:
            print(f"{r['case']:24s} {r['predicted_step_s']:13.3f} s {r['measured_step_s']:21.3f} s")
        print(f"ranking by predicted step time: {by_pred}")
        print(f"ranking by measured step time:  {by_meas}  -> {'match' if by_pred == by_meas else 'MISMATCH'}")
        result.update(ranking_predicted=by_pred, ranking_measured=by_meas, ranking_matches=by_pred == by_meas)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
