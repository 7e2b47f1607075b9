"""What a rank's process costs in CPU until its first step, two ways, in the same run:

- fresh: a new interpreter imports Ray, our worker module and the engine (workers.warmup.import_engine:
  torch, DTensor, DCP) and takes the worker's warm step (workers.warmup.warm_step: the job's model built
  and one step of one sequence): what each replacement, spare or grow-back worker pays today;
- forked: a child forked from a process that already made the same imports (Ray's module imported but
  never initialized: a process with Ray's threads must not fork) takes the same warm step; the imported
  pages are shared copy-on-write.

On hosts whose cores train (CPU jobs, or this 2-core VM), a start-up's CPU is taken from the steps
running beside it: it was most of goodput_bench's lost time. The model is the demo's (preset debug,
sequences of 128) on synthetic data.

Then the same where users meet it, in a job through the supervisor (goodput_bench's: 4 ranks on a
2-node LocalCluster, the demo's model), once with resources.fork_workers (each worker forked by its
node's zygote, workers.zygote) and once without (a fresh interpreter each): a training rank is
SIGKILLed at step 20, and the CPU its replacement's processes used until it was ready (replica_ready)
is read from /proc: the worker's process, and with a zygote the client Ray started in its place
(Ray's setup_worker runs in that process before it execs the client).

Last, a job's own start where users wait for it: on one 2-node LocalCluster, jobs of goodput_bench's
spec (10 steps) one after another, interleaved: a job set up like the one before it, whose workers fork
from the zygotes that job left on its nodes (jobs of one workers.zygote_client.env_key share them), and
a job with an environment of its own (one more variable), whose nodes start a zygote for it, as every
job's did before 2026-12-05. Each job: from its submission to its first completed step.
Run: .venv/bin/python -m tests.benchmarks.startup_bench [--rounds N] [--no-job]
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


def _cpu_s(pid: int) -> float:
    """utime + stime of a live process (/proc/PID/stat), in seconds; 0 for one that is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def replacement_cpu(fork: bool) -> tuple[float, bool]:
    """(CPU-s of a replacement worker until it is ready, whether it was forked), in a job through the
    supervisor on a private 2-node LocalCluster."""
    import signal
    import tempfile
    import time

    from service.local_cluster import LocalCluster
    from tests.benchmarks import goodput_bench as gb
    from tests.runtime.jobs import JobRun, worker_infos

    with tempfile.TemporaryDirectory(prefix="startup_bench_") as d, \
            LocalCluster(head_cpus=gb.NODE_CPUS, object_store_mb=300) as cluster:  # fmt: skip
        cluster.add_node("b", num_cpus=gb.NODE_CPUS)
        cluster.connect()
        spec = gb._ours_spec(Path(d) / "job")
        spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"fork_workers": fork})})
        run = JobRun(spec)
        try:
            metrics = Path(d) / "job" / "metrics.jsonl"
            deadline = time.monotonic() + 300
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 20):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the job did not reach step 20: {run.kinds()}")
                run.poll()
                time.sleep(0.2)
            infos = worker_infos(run.job_id)
            old = {int(i["pid"]) for i in infos}
            victim = next(i for i in infos if i["rank"] == 1 and i["phase"] == "training")
            t0 = time.time()
            os.kill(int(victim["pid"]), signal.SIGKILL)
            while True:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no replacement was ready: {run.kinds()}")
                run.poll()
                if any(e["kind"] == "replica_ready" and float(e["ts"]) > t0 for e in run.events):
                    break
                time.sleep(0.1)
            new = next(i for i in worker_infos(run.job_id) if int(i["pid"]) not in old)
            # The worker's os.environ, not /proc/PID/environ: that file shows a fork's exec-time
            # environment (its zygote's), so it never names the client.
            pid, client = int(new["pid"]), int(new["ray_pid"])
            cpu = _cpu_s(pid) + (_cpu_s(client) if client != pid else 0.0)
            return cpu, bool(new.get("forked"))
        finally:
            run.finish()


def job_starts(rounds: int) -> tuple[list[float], list[float]]:
    """(seconds from submission to the first step of each job forked by warm zygotes, of each job that
    started its own), `rounds` of each, interleaved, on one private 2-node LocalCluster."""
    import json
    import tempfile
    import time

    from service.local_cluster import LocalCluster
    from tests.benchmarks import goodput_bench as gb
    from tests.runtime.jobs import JobRun

    def one(root: Path, env: dict[str, str]) -> float:
        spec = gb._ours_spec(root)
        spec = spec.model_copy(update={"training": spec.training.model_copy(update={"steps": 10}),
                                       "runtime_env": spec.runtime_env.model_copy(update={"env_vars": env})})
        t0 = time.time()
        run = JobRun(spec)
        try:
            st = run.wait(timeout_s=300)
        finally:
            run.finish()
        if st["state"] != "SUCCEEDED":
            raise RuntimeError(f"a startup_bench job ended {st['state']}: {run.kinds()}")
        first = json.loads((root / "metrics.jsonl").read_text().splitlines()[0])
        return float(first["end_time"]) - t0

    warm: list[float] = []
    cold: list[float] = []
    with tempfile.TemporaryDirectory(prefix="startup_bench_") as d, \
            LocalCluster(head_cpus=gb.NODE_CPUS, object_store_mb=300) as cluster:  # fmt: skip
        cluster.add_node("b", num_cpus=gb.NODE_CPUS)
        cluster.connect()
        shared = {"STARTUP_BENCH": "shared"}
        one(Path(d) / "first", shared)  # (starts the shared zygotes: not timed)
        for i in range(rounds):
            cold.append(one(Path(d) / f"own-{i}", {**shared, "STARTUP_BENCH_OWN": str(i)}))
            warm.append(one(Path(d) / f"alike-{i}", shared))
    return warm, cold


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fork-server", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--no-job", action="store_true", help="skip the measurements in jobs")
    ap.add_argument("--job-starts", action="store_true", help="only the job starts (shared zygotes or own)")
    args = ap.parse_args(argv or [])
    if args.fork_server:
        exec(IMPORTS, {})  # noqa: S102 - Ray's module imported, never initialized
        print(" ".join(f"{forked():.4f}" for _ in range(args.fork_server)))
        return
    if args.job_starts:
        _print_job_starts(args.rounds)
        return
    cold = [fresh() for _ in range(args.rounds)]
    warm = fork_server(args.rounds)
    med = sorted(cold)[len(cold) // 2], sorted(warm)[len(warm) // 2]
    print("arm      CPU-s to the first step (each round)")
    print("fresh    " + "  ".join(f"{x:.2f}" for x in cold))
    print("forked   " + "  ".join(f"{x:.2f}" for x in warm))
    print(f"startup: fresh {med[0]:.2f} CPU-s, forked {med[1]:.2f} CPU-s, forked/fresh {med[1] / med[0]:.2f}")
    if args.no_job:
        return
    (fresh_job, f0), (forked_job, f1) = replacement_cpu(False), replacement_cpu(True)
    if f0 or not f1:
        raise RuntimeError(f"the arms did not start as asked: forked {f0} without a zygote, {f1} with one")
    print(f"in a job: a replacement worker's CPU until ready: fresh {fresh_job:.2f} CPU-s, forked by the "
          f"node's zygote {forked_job:.2f} CPU-s, forked/fresh {forked_job / fresh_job:.2f}")
    _print_job_starts(args.rounds)


def _print_job_starts(rounds: int) -> None:
    warm, cold = job_starts(rounds)
    med = sorted(warm)[len(warm) // 2], sorted(cold)[len(cold) // 2]
    print("job start, submission to first step (s, each round)")
    print("own zygotes      " + "  ".join(f"{x:.2f}" for x in cold))
    print("shared zygotes   " + "  ".join(f"{x:.2f}" for x in warm))
    print(f"job start: own zygotes {med[1]:.2f} s, shared {med[0]:.2f} s, shared/own {med[0] / med[1]:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
