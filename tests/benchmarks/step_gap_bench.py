"""Our fault-free step against TorchFT's, on goodput_bench's job, and where the difference goes.

goodput_bench's ETTR compares each framework with its own fault-free run, so it hides a gap in the
fault-free step itself: on 2026-12-07 ours was 0.44-0.49 s at width 4 and TorchFT's 0.24 s, on the
same model, batches and cores. A slower step also meets more of a schedule's faults in its 300 steps.
This runs the same fault-free job (fewer steps) through the supervisor on one private 2-node
LocalCluster, in rounds, each variant once a round so a drift of the VM's share spreads over all:

  torchft            TorchFT's arm (goodput_bench): 4 replica groups, one flat gloo allreduce a step
  shard              ours as goodput_bench runs it: FSDP over 4 ranks (dp_shard 4), a snapshot every step
  shard, no snapshot the same without in-memory snapshots
  replicate          DDP over 4 ranks (dp_replicate 4), a snapshot every step
  replicate, no snap DDP without snapshots: the layout TorchFT's arm has, and no snapshot
  shard, unit a block as `shard` with an FSDP unit per block (fsdp_unit_mib 0): how every job ran before
                     blocks were grouped into units (parallel.layout_rules.fsdp_units)

and prints each one's mean step and its ratio to TorchFT's; the last line splits our gap by the
differences between the variants (snapshots, layout, the rest of our worker).

Run: .venv/bin/python -m tests.benchmarks.step_gap_bench [--steps N] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.benchmarks import goodput_bench as gb
from tests.benchmarks._torchft_runner import run_torchft_width

STEPS = 60
ROUNDS = 2
TORCHFT_TIMEOUT_S = 1.0  # its best in every goodput_bench run: the shortest that runs fault-free

SHARD = {"dp_shard": gb.WORLD}
REPLICATE = {"dp_shard": 1, "dp_replicate": gb.WORLD}
VARIANTS: dict[str, dict[str, Any]] = {
    "shard": {"parallelism": SHARD, "in_memory_every": 1},
    "shard, no snapshot": {"parallelism": SHARD, "in_memory_every": 0},
    "replicate": {"parallelism": REPLICATE, "in_memory_every": 1},
    "replicate, no snap": {"parallelism": REPLICATE, "in_memory_every": 0},
    "shard, unit a block": {"parallelism": {**SHARD, "fsdp_unit_mib": 0}, "in_memory_every": 1},
}


def split_gap(means: dict[str, float]) -> str:
    """Our gap to TorchFT (as goodput_bench runs us), split by what each variant takes away."""
    tf, ours = means["torchft"], means["shard"]
    snapshots = ours - means["shard, no snapshot"]
    layout = means["shard, no snapshot"] - means["replicate, no snap"]
    rest = means["replicate, no snap"] - tf
    return (
        f"step gap: ours {ours / tf:.2f}x torchft ({ours:.3f} against {tf:.3f} s): snapshots {snapshots:+.3f} s, "
        f"FSDP against DDP {layout:+.3f} s, the rest of our worker {rest:+.3f} s"
    )


def measure(steps: int, rounds: int) -> dict[str, list[float]]:
    from service.local_cluster import LocalCluster

    full = gb.set_job(steps, gb.MODEL, gb.TRAINING["seq_len"], gb.TRAINING["global_batch_size"])
    times: dict[str, list[float]] = {"torchft": [], **{name: [] for name in VARIANTS}}
    try:
        with tempfile.TemporaryDirectory(prefix="step_gap_") as d, \
                LocalCluster(head_cpus=gb.NODE_CPUS, object_store_mb=300) as cluster:  # fmt: skip
            cluster.add_node("b", num_cpus=gb.NODE_CPUS)
            cluster.connect()
            runs: dict[str, Callable[[Path], Any]] = {
                "torchft": lambda p: run_torchft_width(p, gb.WORLD, TORCHFT_TIMEOUT_S),
                **{
                    name: (lambda p, kw=kw: gb.run_ours(p, cluster, [], dp=gb.WORLD, **kw))
                    for name, kw in VARIANTS.items()
                },
            }
            losses: dict[str, float] = {}
            for r in range(rounds):
                for name, run in runs.items():
                    out = run(Path(d) / f"{r}-{name.replace(', ', '-').replace(' ', '_')}")
                    assert len(out.steps) == steps, f"{name}: {len(out.steps)} of {steps} steps"
                    times[name].append(gb.step_s(out))
                    losses[name] = out.final_loss
                    print(
                        f"  round {r + 1}: {name:20s} {times[name][-1]:.3f} s a step, final loss {out.final_loss:.4f}",
                        flush=True,
                    )
            # Every variant trains the same model on the same batches: the same trajectory.
            assert max(losses.values()) - min(losses.values()) <= 1e-4, losses
    finally:
        gb.set_job(*full)
    return times


def report(times: dict[str, list[float]]) -> str:
    means = {name: statistics.mean(t) for name, t in times.items()}
    tf = means["torchft"]
    print(f"\n{'variant':22s} {'step s (mean)':>13s} {'runs':>24s} {'x torchft':>10s}")
    for name, t in times.items():
        print(
            f"{name:22s} {means[name]:13.3f} {' / '.join(f'{x:.3f}' for x in t):>24s} {means[name] / tf:10.2f}"
        )
    line = split_gap(means)
    print(line)
    return line


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    args = ap.parse_args(argv if argv is not None else [])
    print(
        f"{args.steps} fault-free steps of goodput_bench's job ({gb.MODEL}), {args.rounds} round(s), "
        f"{gb.WORLD} ranks on a 2-node LocalCluster",
        flush=True,
    )
    report(measure(args.steps, args.rounds))


if __name__ == "__main__":
    main(sys.argv[1:])
