"""The chaos soak (`make soak`): one long job through the user's path under a seeded storm of faults.

    python -m tests.soak.soak [--steps 400] [--faults 22] [--seed N] [--nodes 3]

The world is started as users start it (tests/soak/services.py: PostgreSQL, S3, `ray start` nodes,
`unbroken serve`); the job is submitted with the SDK, its in-job faults in its `chaos` list; the driver
fires the faults of the service's own parts when the job's progress reaches their step, and those
inside a recovery when the fault before them is detected. Then tests/soak/checks.py judges the run and
the table is printed: fault, step, detected as, recovery time, lost steps. Exit status 1 on any problem.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.soak import checks
from tests.soak.schedule import RECOVERY_KINDS, SERVICE_KINDS, Fault, job_chaos, make_schedule, parse_schedule
from tests.soak.services import SoakServices

T = TypeVar("T")
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
DOWN_S = 3.0  # how long a killed part of the service stays down


@dataclass
class SoakConfig:
    steps: int = 400
    faults: int = 22
    seed: int = 0
    worker_nodes: int = 3
    cpus_per_node: int = 2
    dp_max: int = 4
    persist_every: int = 25
    min_gap: int = 8
    model: Any = None  # None: the debug preset
    schedule: str | None = None  # by hand (schedule.parse_schedule) instead of the seeded one
    timeout_s: float = 3600.0
    root: Path | None = None


@dataclass
class SoakResult:
    verdict: checks.Verdict
    table: str
    job_id: str
    wall_s: float
    driver_log: list[str]


def job_spec(cfg: SoakConfig, schedule: list[Fault]) -> dict[str, Any]:
    return {
        "name": "soak",
        "model": cfg.model or {"preset": "debug", "max_seq_len": 64},
        "data": {"kind": "text", "path": str(Path(sysconfig.get_paths()["stdlib"]) / "json")},
        "training": {"steps": cfg.steps, "seq_len": 32, "global_batch_size": 8, "warmup_steps": 5},
        "parallelism": {"dp_shard": -1},
        "resources": {"cpus_per_worker": 1, "dp": {"min": 2, "max": cfg.dp_max}},
        "checkpoint": {"in_memory_every": 1, "persist_every": cfg.persist_every, "keep_last": 3},
        "fault_tolerance": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 8, "collective_timeout_s": 20,
                            "max_recoveries": 100, "supervisor_max_restarts": 50, "wait_for_capacity_s": 180,
                            "straggler_action": "replace"},
        "chaos": job_chaos(schedule),
    }


def _call(fn: Callable[..., T], *args: Any, within_s: float = 180.0, **kw: Any) -> T:
    """An SDK call that outlives an API or store restart."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return fn(*args, **kw)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _all_events(client: Any, job_id: str) -> list[Any]:
    return list(client.events(job_id, follow=False))


def drive(services: SoakServices, job_id: str, schedule: list[Fault], rng: random.Random,
          timeout_s: float, say: Callable[[str], None]) -> dict[int, tuple[int | None, str]]:  # fmt: skip
    """Fire the driver's faults until the job ends; index -> (step, what was done)."""
    client = services.client()
    pending = {i: f for i, f in enumerate(schedule) if f.kind in SERVICE_KINDS or f.kind in RECOVERY_KINDS}
    acted: dict[int, tuple[int | None, str]] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        job = _call(client.get, job_id)
        if job.status in TERMINAL:
            return acted
        if time.monotonic() > deadline:
            raise TimeoutError(f"the soak's job is not done after {timeout_s:g}s: {job.status} at {job.progress}")
        step = int(job.progress.step or 0) if job.progress else 0
        for note in services.replace_lost_nodes():
            say(f"step {step}: {note}")
        events: list[Any] | None = None
        for i, f in sorted(pending.items()):
            if f.kind in SERVICE_KINDS and step >= f.step:
                what = getattr(services, f.kind)(DOWN_S)
            elif f.kind in RECOVERY_KINDS and step >= f.step - 2:
                if events is None:
                    events = _call(_all_events, client, job_id)
                # The fault it interrupts is detected (a failure at its step) and not yet recovered from.
                hit = [j for j, e in enumerate(events) if e.kind == "failure_detected"
                       and f.step - 1 <= int((e.data or {}).get("step") or 0) <= f.step + 2]
                if not hit and step > f.step + 20:  # its fault acted unseen (while the supervisor restarted)
                    acted[i] = (None, "skipped: the fault whose recovery it was to interrupt started none")
                    pending.pop(i)
                    say(f"step {step}: {f.label}: {acted[i][1]}")
                    continue
                if not hit:
                    continue
                after = [e.kind for e in events[hit[0] + 1:]]
                when = "after its recovery ended" if "recovered" in after else "during the recovery"
                what = (services.sigkill_supervisor() if f.kind.startswith("kill_supervisor")
                        else services.sigkill_worker(rng)) + f" ({when})"
            else:
                continue
            acted[i] = (step, what)
            pending.pop(i)
            say(f"step {step}: {f.label}: {what}")
            if f.kind == "kill_api":
                client = services.client()
        time.sleep(0.25)


def run_soak(cfg: SoakConfig, say: Callable[[str], None] = print) -> SoakResult:
    t0 = time.monotonic()
    rng = random.Random(cfg.seed)
    schedule = (parse_schedule(cfg.schedule, cfg.persist_every) if cfg.schedule else
                make_schedule(cfg.seed, steps=cfg.steps, faults=cfg.faults, persist_every=cfg.persist_every,
                              min_gap=cfg.min_gap))
    root = cfg.root or Path(tempfile.mkdtemp(prefix="soak-"))
    spec = job_spec(cfg, schedule)
    say(f"soak: seed {cfg.seed}, {cfg.steps} steps, {len(schedule)} faults; the fault-free run first (one process)")
    ref = checks.reference_losses(spec, root / "reference")
    services = SoakServices(root, worker_nodes=cfg.worker_nodes, cpus_per_node=cfg.cpus_per_node).start()
    log: list[str] = []

    def note(line: str) -> None:
        log.append(line)
        say(line)

    try:
        spec["checkpoint"] |= services.job_checkpoint()
        client = services.client()
        job = client.submit(spec)
        note(f"job {job.id} submitted through the SDK to {services.serve.url if services.serve else '?'}")
        acted = drive(services, job.id, schedule, rng, cfg.timeout_s, note)
        client = services.client()
        final = _call(client.get, job.id)
        events = _call(_all_events, client, job.id)
        metrics = _call(client.metrics, job.id)
        ckpt = spec["checkpoint"]
        ckpts = checks.checkpoints(f"{ckpt['uri']}/{job.id}", ckpt["s3"])
        assert services.cluster is not None
        leak = checks.leaks(services.cluster.env, services.cluster.address, job.id)
        logs = _call(lambda: [x.line for x in client.logs(job.id)])
        rows = checks.match_events(schedule, acted, events, logs)
        (root / "events.json").write_text(json.dumps([e.model_dump() for e in events]))
        (root / "events.txt").write_text("".join(f"{e.ts:.2f} {e.kind}: {e.message} {e.data or ''}\n"
                                                 for e in events))
        verdict = checks.judge(rows, status=final.status, reason=final.reason, steps=cfg.steps, metrics=metrics, ref=ref, ckpts=ckpts,
                               leak=leak, events=events)
        note(f"checkpoints left: {[(s, ok) for s, ok, _ in ckpts]}; leaks: {leak}; events in {root / 'events.txt'}")
        return SoakResult(verdict, checks.table(rows), job.id, time.monotonic() - t0, log)
    finally:
        services.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--faults", type=int, default=22)
    ap.add_argument("--seed", type=int, default=None, help="default: random, printed")
    ap.add_argument("--nodes", type=int, default=3, help="worker nodes (2 CPUs each)")
    ap.add_argument("--schedule", default=None, help='faults by hand instead: "kill_keeper@10,kill_worker@20:1"')
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny model instead of the debug preset")
    a = ap.parse_args(argv)
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    model = None
    if a.tiny:
        from tests.runtime.jobs import TINY_MODEL

        model = TINY_MODEL
    res = run_soak(SoakConfig(steps=a.steps, faults=a.faults, seed=seed, worker_nodes=a.nodes, schedule=a.schedule,
                              model=model))
    print(f"\nsoak: seed {seed}, job {res.job_id}, {res.wall_s:.0f}s\n")
    print(res.table)
    print()
    if res.verdict.ok:
        print("soak: PASSED (SUCCEEDED; losses = the fault-free run <= 1e-4; <= 1 lost step per failure; "
              "checkpoints valid; no leaks; every fault in the events)")
        return 0
    print("soak: FAILED")
    for p in res.verdict.problems:
        print(f"  - {p}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
