"""What the per-step metrics cost the train step: `workers.telemetry.record_step` inside a Ray
actor (where workers call it), per call, against the same loop without it; and that cost as a
fraction of a tiny-model CPU step measured in the same run.

    .venv/bin/python -m tests.benchmarks.telemetry_bench
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback Ray (see service/local_cluster.py)

CALLS = 20_000


@dataclass
class _Step:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    mfu: float | None


def _timed(n: int, record: bool) -> float:
    from workers import telemetry

    t0 = time.perf_counter()
    for i in range(n):
        m = _Step(i, 1.0, 0.1, 1.0, None)
        if record:
            telemetry.record_step("bench", 0, m)
    return (time.perf_counter() - t0) / n


def _tiny_step_s() -> float:
    import torch

    from parallel.config import EngineConfig
    from parallel.trainer import Trainer

    cfg = EngineConfig.model_validate({"model": {"preset": "tiny"},
                                       "training": {"steps": 12, "seq_len": 64, "global_batch_size": 8}})
    trainer = Trainer(cfg, device=torch.device("cpu"))
    times = [trainer.train_step().step_time_s for _ in range(12)]
    return sorted(times[2:])[len(times[2:]) // 2]


def main() -> dict[str, Any]:
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        probe = ray.remote(num_cpus=0)(_timed)
        ray.get(probe.remote(10, True))  # the metric objects are made on first use
        with_s = ray.get(probe.remote(CALLS, True))
        without_s = ray.get(probe.remote(CALLS, False))
        step_s = ray.get(ray.remote(num_cpus=0)(_tiny_step_s).remote())
    finally:
        ray.shutdown()
    per_call = with_s - without_s
    print(f"record_step: {per_call * 1e6:.1f} us per call; tiny CPU step {step_s * 1e3:.1f} ms; "
          f"cost/step ratio {per_call / step_s:.5f}")
    return {"record_step_s": per_call, "tiny_step_s": step_s, "ratio": per_call / step_s}


if __name__ == "__main__":
    main()
