"""Pipeline schedules: throughput of each on the same model, and measured against theoretical bubble.

pp=2 (two ranks, one core each) runs every schedule with m micro-batches through the Trainer.
The reference is one process running the same micro-batches (micro_batch_size = batch/m), so the
ideal pipelined step is its time / pp; the measured bubble is 1 − ideal / measured step time
(it also holds communication and scheduling overhead, which the formula leaves out). The
theoretical bubble is (p−1)/m for gpipe/1f1b and (p−1)/(v·m) for the interleaved schedules.
The reference runs inside the same launch (rank 0 alone, the other rank idle) right before the
pipelined runs, so both see the same machine load; step time is the fastest step after the
first WARMUP (the least disturbed by other processes on a shared machine).
"""

from __future__ import annotations

import os
from typing import Any

STEPS = 10
WARMUP = 3
PP = 2
MICRO = (4, 8)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
JOB: dict[str, Any] = {
    "model": {"preset": "debug", "n_layers": 8},
    "training": {"steps": STEPS, "seq_len": 128, "global_batch_size": 16, "warmup_steps": 1},
}


def _cfg(parallelism: dict[str, Any], training: dict[str, Any] | None = None) -> Any:
    from tests.parallel.rank_fns import make_cfg

    return make_cfg(JOB, parallelism, training)


def _steady(step_times: list[float]) -> float:
    return min(step_times[WARMUP:])


def _layouts() -> list[tuple[str, int, dict[str, Any]]]:
    out = []
    for m in MICRO:
        for s in SCHEDULES:
            v = 1 if s in ("gpipe", "1f1b") else 2
            out.append((s, m, {"pp": PP, "pp_schedule": s, "pp_microbatches": m, "pp_stages_per_rank": v}))
    return out


def rank_body(ctx: Any, payload: Any) -> dict[str, float]:
    """Runs in each of the PP ranks: per m the one-process reference, then every schedule,
    each in a fresh group."""
    import torch

    from parallel.trainer import Trainer

    times: dict[str, float] = {}
    done_ref: set[int] = set()
    for s, m, par in _layouts():
        if m not in done_ref:
            done_ref.add(m)
            ref = ctx.in_group(1, f"ref-{m}", lambda m=m: single_process(m))
            if ref is not None:
                times[f"ref/{m}"] = ref
        def body(par: dict[str, Any] = par) -> float:
            trainer = Trainer(_cfg(par), device=torch.device("cpu"))
            return _steady([trainer.train_step().step_time_s for _ in range(STEPS)])

        t = ctx.in_group(PP, f"{s}-{m}", body)
        if t is not None:
            times[f"{s}/{m}"] = t
    return times


def single_process(micro: int) -> float:
    import torch

    from parallel.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank (OMP_NUM_THREADS=1)
    try:
        mbs = JOB["training"]["global_batch_size"] // micro
        trainer = Trainer(_cfg({}, {"micro_batch_size": mbs}), device=torch.device("cpu"))
        return _steady([trainer.train_step().step_time_s for _ in range(STEPS)])
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from parallel.planner.timing import bubble_fraction
    from tests.parallel.harness import launch

    tokens = JOB["training"]["global_batch_size"] * JOB["training"]["seq_len"]
    times = launch("tests.benchmarks.pipeline_bench:rank_body", PP, None, timeout_s=900)[0]
    ref = {m: times[f"ref/{m}"] for m in MICRO}
    print(f"model {JOB['model']}, {tokens} tokens/step, pp={PP} on {os.cpu_count()} cores; "
          f"fastest step after {WARMUP}")
    print(f"{'schedule':<18}{'m':>3}{'step s':>9}{'tokens/s':>11}{'vs 1 proc':>10}"
          f"{'bubble theory':>15}{'bubble measured':>17}")
    for m in MICRO:
        print(f"{'1 process':<18}{m:>3}{ref[m]:>9.3f}{tokens / ref[m]:>11,.0f}{1.0:>9.2f}x{'-':>15}{'-':>17}")
        for s, mm, par in _layouts():
            if mm != m:
                continue
            t = times[f"{s}/{m}"]
            theory = bubble_fraction(s, PP, m, par["pp_stages_per_rank"])
            measured = 1.0 - (ref[m] / PP) / t
            print(f"{s:<18}{m:>3}{t:>9.3f}{tokens / t:>11,.0f}{ref[m] / t:>9.2f}x"
                  f"{theory:>15.3f}{measured:>17.3f}")


if __name__ == "__main__":
    main()
