"""Engine throughput per parallel layout, as ratios to one process, measured in one run.

On the CPU (gloo) the figures say what each layout costs in communication on one machine, not
what it gains on GPUs: 4 ranks share the same cores. With CUDA present, one device also runs the
`small` model in bf16 and reports tokens/s and MFU (6N + attention FLOPs per token, torchtitan's
definition, against the device's dense bf16 peak).

Steady-state tokens/s is the median over the steps after the first WARMUP.
Usage: python -m tests.benchmarks.layouts_bench
"""

from __future__ import annotations

import statistics
from typing import Any

STEPS = 12
WARMUP = 4
BASE: dict[str, Any] = {
    "model": {"preset": "debug"},
    "training": {"steps": STEPS, "seq_len": 128, "global_batch_size": 8, "warmup_steps": 2},
}
LAYOUTS: list[dict[str, Any]] = [
    dict(name="fsdp2", world=2),
    dict(name="tp2", world=2, parallelism={"tp": 2}),
    dict(name="fsdp4", world=4),
    dict(name="fsdp4 zero2", world=4, parallelism={"zero_stage": 2}),
    dict(name="hsdp 2x2", world=4, parallelism={"dp_replicate": 2}),
    dict(name="fsdp2 x tp2", world=4, parallelism={"tp": 2}),
    dict(name="fsdp4 ac=full", world=4, training={"activation_checkpointing": "full"}),
]


def _steady(tps: list[float]) -> float:
    return statistics.median(tps[WARMUP:])


def single_process() -> tuple[float, int]:
    import torch

    from parallel.trainer import Trainer
    from tests.parallel.rank_fns import make_cfg

    trainer = Trainer(make_cfg(BASE), device=torch.device("cpu"))
    metrics = [trainer.train_step() for _ in range(STEPS)]
    return _steady([m.tokens_per_s for m in metrics]), metrics[-1].peak_mem_bytes


def gpu_mfu() -> None:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: MFU is not measured (the CPU has no known peak)")
        return
    from parallel.trainer import Trainer
    from tests.parallel.rank_fns import make_cfg

    base = {"model": {"preset": "small", "vocab_size": 32000},
            "training": {"steps": STEPS, "seq_len": 2048, "global_batch_size": 8, "dtype": "bfloat16"}}
    trainer = Trainer(make_cfg(base), device=torch.device("cuda"))
    metrics = [trainer.train_step() for _ in range(STEPS)]
    steady = metrics[WARMUP:]
    tps = statistics.median(m.tokens_per_s for m in steady)
    mfus = [m.mfu for m in steady if m.mfu is not None]
    mfu_text = f"{statistics.median(mfus):.1%}" if mfus else "unknown peak"
    print(f"{torch.cuda.get_device_name()}: small bf16, 1 device: {tps:,.0f} tokens/s, MFU {mfu_text}, "
          f"peak {metrics[-1].peak_mem_bytes / 2**30:.2f} GiB")


def main() -> None:
    from tests.parallel.harness import launch

    one, one_mem = single_process()
    runs = launch("tests.parallel.rank_fns:bench_layouts",
                  4, {"base": BASE, "layouts": LAYOUTS}, timeout_s=600)[0]
    print(f"model {BASE['model']['preset']}, seq {BASE['training']['seq_len']}, global batch "
          f"{BASE['training']['global_batch_size']}, CPU/gloo; tokens/s are for the whole job")
    print(f"{'layout':<16}{'tokens/s':>12}{'vs 1 proc':>11}{'peak RSS/rank':>15}")
    print(f"{'1 process':<16}{one:>12,.0f}{1.0:>11.2f}{one_mem / 2**20:>12.0f} MiB")
    for lay in LAYOUTS:
        r = runs[lay["name"]]
        tps = _steady(r["tokens_per_s"])
        print(f"{lay['name']:<16}{tps:>12,.0f}{tps / one:>11.2f}{r['peak_mem'] / 2**20:>12.0f} MiB")
    gpu_mfu()


if __name__ == "__main__":
    main()
