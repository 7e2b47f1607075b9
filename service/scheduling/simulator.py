"""A SIMULATION of the scheduler: a seeded trace of jobs replayed against the real scheduling policies
(service.scheduling.policies.plan, the code the live Scheduler runs) on a simulated clock and cluster.

Nothing here trains: a job is an amount of work in replica-seconds, done at a rate equal to its
data-parallel degree. What the simulation models, and its costs (all in simulated seconds):
- a job starts `start_s` after admission (placement, process start, model build) and does no work then;
- a planned resize (shrink or grow) pauses the job `resize_s` (pause at a snapshot, re-form, restore from
  memory) and loses no work; capacity a shrink frees is free only once the resize is done;
- kill-based preemption stops the whole job, which loses the work since its last checkpoint (every
  `checkpoint_every_s` of its run time) and waits in the queue again; it pays `start_s` again.

Three policy families run on the same trace: "fifo" (gang admission in priority then FIFO order, growth
into free capacity; the scheduler before elastic sharing), "kill" (the same plus kill-based preemption of
lower-priority jobs, as Kubernetes queues do) and "shrink" (shrink to share, grow to fill).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, field

from service.scheduling.policies import MODES, Mode, plan
from service.scheduling.snapshot import JobView, Snapshot

HIGH = 10  # the priority of urgent jobs in the trace


@dataclass(frozen=True)
class TraceJob:
    id: str
    owner: str
    priority: int
    arrival_s: float
    dp_min: int
    dp_max: int
    work: float  # replica-seconds


@dataclass(frozen=True)
class Costs:
    start_s: float = 60.0
    resize_s: float = 10.0
    checkpoint_every_s: float = 600.0


def make_trace(seed: int, n_jobs: int = 60, *, mean_gap_s: float = 450.0, high_share: float = 0.2) -> list[TraceJob]:
    """A seeded trace: Poisson arrivals, a share of urgent (priority 10) jobs that are mostly small and
    rigid, elastic background jobs of several sizes, three owners, run times of 10 minutes to 2 hours."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n_jobs):
        t += rng.expovariate(1.0 / mean_gap_s)
        high = rng.random() < high_share
        dp_min = rng.choice([1, 2, 2, 4]) if high else rng.choice([1, 2, 4])
        dp_max = dp_min if high and rng.random() < 0.7 else dp_min * rng.choice([1, 2, 4, 4])
        minutes = math.exp(rng.uniform(math.log(10), math.log(120)))
        out.append(TraceJob(f"j{i:03d}", rng.choice(["ana", "bo", "cy"]), HIGH if high else rng.choice([0, 0, 5]),
                            t, dp_min, dp_max, minutes * 60.0 * dp_max))
    return out


@dataclass
class _Job:
    spec: TraceJob
    seq: int
    done: float = 0.0  # replica-seconds of work kept
    dp: int = 0
    target: int = 0
    busy_until: float = 0.0  # starting or resizing: no work until then
    resize_at: float | None = None  # when the pending resize to `target` is done
    admitted_s: float | None = None  # the first admission
    run_s: float = 0.0  # run time since the last (re)start, for checkpoints
    saved: float = 0.0  # work at the last checkpoint
    finished_s: float | None = None
    preemptions: int = 0
    lost: float = 0.0

    def view(self) -> JobView:
        s = self.spec
        return JobView(s.id, s.owner, s.priority, self.seq, {"CPU": 1.0}, 1, s.dp_min, s.dp_max, self.dp, self.target)


@dataclass
class Result:
    mode: str
    jct: list[float] = field(default_factory=list)
    high_wait: list[float] = field(default_factory=list)
    utilisation: float = 0.0
    makespan_s: float = 0.0
    resizes: int = 0
    preemptions: int = 0
    lost_work: float = 0.0

    def row(self) -> dict[str, float | str]:
        return {"mode": self.mode, "mean_jct_s": statistics.fmean(self.jct), "p95_jct_s": _p95(self.jct),
                "high_wait_mean_s": statistics.fmean(self.high_wait) if self.high_wait else 0.0,
                "high_wait_p95_s": _p95(self.high_wait) if self.high_wait else 0.0,
                "utilisation": self.utilisation, "makespan_s": self.makespan_s, "resizes": self.resizes,
                "preemptions": self.preemptions, "lost_work": self.lost_work}


def _p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]


def simulate(trace: list[TraceJob], mode: Mode, *, capacity: int = 32, costs: Costs | None = None,
             dt: float = 5.0, max_s: float = 30 * 86400.0) -> Result:
    """Replay `trace` under `mode` on a cluster of `capacity` one-CPU replicas; the metrics of the run."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} must be one of {MODES}")
    costs = costs or Costs()
    jobs = {j.id: _Job(j, i) for i, j in enumerate(sorted(trace, key=lambda j: j.arrival_s))}
    pending = sorted(jobs.values(), key=lambda j: j.spec.arrival_s)
    queue: list[_Job] = []
    running: dict[str, _Job] = {}
    res = Result(mode)
    busy = 0.0
    now, dirty, freed_by = 0.0, True, None
    while (pending or queue or running) and now < max_s:
        while pending and pending[0].spec.arrival_s <= now:
            queue.append(pending.pop(0))
            dirty = True
        for j in running.values():
            if j.resize_at is not None and j.resize_at <= now:
                j.dp, j.resize_at, dirty = j.target, None, True
        if dirty:
            dirty = False
            held = sum(max(j.dp, j.target) for j in running.values())
            snap = Snapshot({"CPU": float(capacity)}, {"CPU": float(capacity - held)},
                            tuple(j.view() for j in running.values()), tuple(j.view() for j in queue))
            p = plan(snap, mode, freed_by=freed_by)
            for r in p.resizes:
                j = running[r.job_id]
                j.target, j.resize_at = r.new, now + costs.resize_s
                j.busy_until = max(j.busy_until, now + costs.resize_s)
                res.resizes += 1
                freed_by = None if r.kind == "grow" else freed_by
            for jid in p.preempt:
                j = running.pop(jid)
                j.lost += j.done - j.saved
                j.done, j.dp, j.target, j.resize_at, j.run_s = j.saved, 0, 0, None, 0.0
                j.preemptions += 1
                queue.append(j)
                dirty = True
            for jid, dp in p.admit.items():
                j = next(q for q in queue if q.spec.id == jid)
                queue.remove(j)
                j.dp = j.target = dp
                j.busy_until = now + costs.start_s
                j.admitted_s = now if j.admitted_s is None else j.admitted_s
                running[jid] = j
        busy += dt * sum(j.dp for j in running.values() if j.busy_until <= now) / capacity
        for jid, j in list(running.items()):
            if j.busy_until > now:
                continue
            j.run_s += dt
            j.done += j.dp * dt
            if j.run_s // costs.checkpoint_every_s > (j.run_s - dt) // costs.checkpoint_every_s:
                j.saved = j.done
            if j.done >= j.spec.work:
                over = (j.done - j.spec.work) / j.dp  # it finished within this interval
                j.finished_s = now + dt - over
                running.pop(jid)
                freed_by, dirty = jid, True
        now += dt
    done = [j for j in jobs.values() if j.finished_s is not None]
    if len(done) < len(jobs):
        raise RuntimeError(f"{len(jobs) - len(done)} job(s) never finished in {max_s:g} simulated s ({mode})")
    res.jct = [j.finished_s - j.spec.arrival_s for j in done]  # type: ignore[operator]
    res.high_wait = [j.admitted_s - j.spec.arrival_s for j in done if j.spec.priority >= HIGH]  # type: ignore[operator]
    res.makespan_s = max(j.finished_s for j in done) - min(j.spec.arrival_s for j in done)  # type: ignore[type-var]
    res.utilisation = busy / max(res.makespan_s, dt)  # productive replica-time over the capacity
    res.preemptions = sum(j.preemptions for j in done)
    res.lost_work = sum(j.lost for j in done)
    return res


def compare(seed: int, n_jobs: int = 60, *, capacity: int = 32) -> list[dict[str, float | str]]:
    """The three policy families on one seeded trace: one row each."""
    trace = make_trace(seed, n_jobs)
    return [simulate(trace, m, capacity=capacity).row() for m in MODES]
