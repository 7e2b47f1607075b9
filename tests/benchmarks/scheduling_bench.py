"""Scheduling policies compared in a SIMULATION (service.scheduling.simulator): seeded traces of 60 jobs
each replayed against the real policy code on a simulated clock and a 32-replica cluster, for FIFO gang
admission (the scheduler before elastic sharing), kill-based preemption and shrink-to-share.

Prints, per policy, the mean over the seeds of: mean and p95 job completion time, the queueing delay
of priority-10 jobs (mean and p95), utilisation (productive replica-time over capacity), resizes,
preemptions and the work kill-based preemption threw away; and each against FIFO in the same run.
Usage: python -m tests.benchmarks.scheduling_bench [SEED ...]   (default seeds 1 2 3)
"""

from __future__ import annotations

import statistics
import sys
import time

from service.scheduling.simulator import MODES, make_trace, simulate

N_JOBS = 60
CAPACITY = 32


def table(seeds: list[int]) -> list[dict[str, float | str]]:
    rows: dict[str, list[dict[str, float | str]]] = {m: [] for m in MODES}
    for seed in seeds:
        trace = make_trace(seed, N_JOBS)
        for m in MODES:
            rows[m].append(simulate(trace, m, capacity=CAPACITY).row())
    return [{"mode": m, **{k: statistics.fmean(float(r[k]) for r in rs) for k in rs[0] if k != "mode"}}
            for m, rs in rows.items()]


def main(argv: list[str] | None = None) -> None:
    seeds = [int(a) for a in argv or []] or [1, 2, 3]
    t0 = time.perf_counter()
    rows = table(seeds)
    base = next(r for r in rows if r["mode"] == "fifo")
    print(f"SIMULATION: {N_JOBS} jobs a trace, seeds {seeds}, a cluster of {CAPACITY} replicas; the same "
          f"policy code as the live scheduler ({time.perf_counter() - t0:.1f}s)")
    head = (f"{'policy':8} {'mean JCT s':>11} {'p95 JCT s':>10} {'high wait s':>12} {'high p95 s':>11} "
            f"{'util':>6} {'resizes':>8} {'preempt':>8} {'lost work':>10} {'JCT/fifo':>9} {'wait/fifo':>10}")
    print(head)
    for r in rows:
        print(f"{r['mode']:8} {r['mean_jct_s']:>11.0f} {r['p95_jct_s']:>10.0f} {r['high_wait_mean_s']:>12.1f} "
              f"{r['high_wait_p95_s']:>11.1f} {r['utilisation']:>6.3f} {r['resizes']:>8.1f} {r['preemptions']:>8.1f} "
              f"{r['lost_work']:>10.0f} {float(r['mean_jct_s']) / float(base['mean_jct_s']):>9.3f} "
              f"{float(r['high_wait_mean_s']) / max(float(base['high_wait_mean_s']), 1e-9):>10.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
