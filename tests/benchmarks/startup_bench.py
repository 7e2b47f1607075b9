"""What a rank's process costs in CPU until its first step, two ways, in the same run:

- fresh: a new interpreter imports Ray, our worker module and the engine (workers.warmup.import_engine:
  torch, DTensor, DCP) and takes the worker's warm step (workers.warmup.warm_step: the job's model built
  and one step of one sequence): what each replacement, spare or grow-back worker pays today;
- forked: a child forked from a process that already made the same imports (Ray's module imported but
  never initialized: a process with Ray's threads must not fork) takes the same warm step; the imported
  pages are shared copy-on-write.

On hosts whose cores train (CPU jobs, or this 2-core VM), a start-up's CPU is taken from the steps
running beside it: goodput_bench's lost time is mostly that. The ratio bounds what a per-node fork
server (the worker actor a thin handle over a forked trainer) would save; that design is not built.
The job is the demo's (preset debug, sequences of 128) on synthetic data. Run: .venv/bin/python -m tests.benchmarks.startup_bench [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A worker's own start-up: workers.warmup's engine import, then its warm step (the job's model alone).
FIRST_STEP = """
import torch, yaml
from service.spec import parse_spec
from tests.runtime.jobs import engine_of
from workers.warmup import warm_step
spec = yaml.safe_load(open("examples/demo_job.yaml"))
spec.get("checkpoint", {}).pop("s3", None)
spec["data"] = {"kind": "synthetic"}
assert warm_step(engine_of(parse_spec(spec)), torch.device("cpu"))
"""
IMPORTS = "import ray, workers.worker\nfrom workers.warmup import import_engine\nimport_engine()\n"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def fresh() -> float:
    """CPU-s of a new interpreter: the imports, the model built, one step."""
    before = _children_cpu()
    subprocess.run([sys.executable, "-c", IMPORTS + FIRST_STEP], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return _children_cpu() - before


def forked() -> float:
    """CPU-s of a child of this (engine-imported) process: the model built, one step."""
    before = _children_cpu()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            exec(FIRST_STEP, {})  # noqa: S102 - the same text the fresh arm runs
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("the forked child's first step failed")
    return _children_cpu() - before


def fork_server(rounds: int) -> list[float]:
    """The forked arm, in an interpreter of its own (make bench runs every module in one process, which
    earlier benchmarks left with Ray's and torch's threads: not a process to fork): it makes the fresh
    arm's imports, then forks `rounds` children one after another. Returns their CPU-s."""
    out = subprocess.run([sys.executable, "-m", "tests.benchmarks.startup_bench", "--fork-server", str(rounds)],
                         check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True).stdout
    return [float(x) for x in out.split()[-rounds:]]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fork-server", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv or [])
    if args.fork_server:
        exec(IMPORTS, {})  # noqa: S102 - Ray's module imported, never initialized
        print(" ".join(f"{forked():.4f}" for _ in range(args.fork_server)))
        return
    cold = [fresh() for _ in range(args.rounds)]
    warm = fork_server(args.rounds)
    med = sorted(cold)[len(cold) // 2], sorted(warm)[len(warm) // 2]
    print("arm      CPU-s to the first step (each round)")
    print("fresh    " + "  ".join(f"{x:.2f}" for x in cold))
    print("forked   " + "  ".join(f"{x:.2f}" for x in warm))
    print(f"startup: fresh {med[0]:.2f} CPU-s, forked {med[1]:.2f} CPU-s, forked/fresh {med[1] / med[0]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
