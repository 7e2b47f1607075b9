"""The elastic scheduling decisions, as pure functions over a Snapshot (no Ray, no store, no clock).

- `select_shrinks`: the least disruptive set of shrinks that frees room for a queued job's minimum gang
  (`disruption`): the fewest replicas taken from jobs of the same priority, then the fewest jobs
  touched, then the lowest priorities, then the fewest replicas. Only elastic jobs shrink, never below
  dp.min, never one of higher priority; capacity that growth lent to a job of the same priority is taken
  back as far as lower-priority jobs cannot free it. If everything that may shrink cannot free enough,
  nothing shrinks (None).
- `plan_growth`: free capacity to running jobs below dp.max, one replica at a time, highest priority
  first, then the owner furthest below its weighted fair share (workers / weight), then the oldest job.
- `plan`: one scheduling pass: admission (service.scheduling.admission), then the shrinks for the first
  job that waits for capacity, or, when nothing waits for capacity, growth. `mode` picks the policy
  family the simulator compares: "fifo" (gang admission, no preemption), "kill" (kill-based
  preemption of lower-priority jobs) and "shrink" (shrink to share).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Literal

from service.scheduling.admission import OwnerUsage, QuotaPolicy, plan_admission
from service.scheduling.snapshot import JobView, Resources, Snapshot, add, by_id, covers, sub

Mode = Literal["fifo", "kill", "shrink"]
MODES: tuple[Mode, ...] = ("fifo", "kill", "shrink")
# Subsets of up to this many candidates are searched exhaustively (2^n); beyond, the lowest-priority
# candidates are taken greedily.
EXHAUSTIVE_CANDIDATES = 10


@dataclass(frozen=True)
class Resize:
    job_id: str
    old: int  # the target it had
    new: int
    reason: str  # a sentence for the job's event

    @property
    def kind(self) -> str:
        return "shrink" if self.new < self.old else "grow"


@dataclass(frozen=True)
class Plan:
    admit: dict[str, int] = field(default_factory=dict)  # job id -> the dp it starts at
    resizes: list[Resize] = field(default_factory=list)
    preempt: list[str] = field(default_factory=list)  # "kill" mode only: jobs stopped and queued again
    waiting: dict[str, str] = field(default_factory=dict)  # job id -> why it waits


# ----------------------------------------------------------------------------- shrink selection
def _deficit(need: Resources, free: Resources) -> Resources:
    return {k: v - free.get(k, 0.0) for k, v in need.items() if v - free.get(k, 0.0) > 1e-9}


def _helps(j: JobView, deficit: Resources) -> bool:
    return any(j.replica.get(k, 0.0) > 0 for k in deficit)


def _cover(deficit: Resources, jobs: Sequence[JobView], giveable: Mapping[str, int],
           each_gives: bool = True) -> dict[str, int] | None:
    """Replicas to take from each of `jobs` (in order) to cover `deficit`, each job giving at least one
    (unless not `each_gives`: then those not needed are left out); then trimmed so that no job gives a
    replica the deficit does not need. None if they cannot."""
    take = {j.id: 0 for j in jobs}
    freed: Resources = {}
    for j in jobs:
        while take[j.id] < giveable[j.id] and not covers(freed, deficit):
            take[j.id] += 1
            freed = add(freed, j.replica)
    if not each_gives:
        take = {jid: n for jid, n in take.items() if n}
        jobs = [j for j in jobs if j.id in take]
    if not covers(freed, deficit) or any(n == 0 for n in take.values()):
        return None
    for j in reversed(jobs):  # trim: the earlier (preferred) jobs keep what they give
        while take[j.id] > 1 and covers(sub(freed, j.replica), deficit):
            take[j.id] -= 1
            freed = sub(freed, j.replica)
    return take


def disruption(subset: Sequence[JobView], take: Mapping[str, int], priority: int) -> tuple:
    """How disruptive a set of shrinks is, smaller is better: replicas taken from jobs of equal priority
    (growth's loan taken back only as far as it must be), jobs touched, their priorities (highest
    first), replicas taken."""
    return (sum(take[j.id] for j in subset if j.priority >= priority), len(subset),
            sorted((j.priority for j in subset), reverse=True), sum(take.values()), sorted(take))


def _choose(deficit: Resources, cands: Sequence[JobView], giveable: Mapping[str, int],
            priority: int) -> dict[str, int] | None:
    """The least disruptive cover of `deficit` (by `disruption`; ties to the job ids)."""
    if not deficit:
        return {}
    order = sorted((j for j in cands if giveable[j.id] > 0 and _helps(j, deficit)),
                   key=lambda j: (j.priority, -j.seq))  # lowest priority, then newest, give first
    total: Resources = {}
    for j in order:
        total = add(total, {k: v * giveable[j.id] for k, v in j.replica.items()})
    if not covers(total, deficit):
        return None
    pool = order[:EXHAUSTIVE_CANDIDATES]
    best: tuple | None = None
    for k in range(1, len(pool) + 1):
        for subset in combinations(pool, k):
            take = _cover(deficit, subset, giveable)
            if take is not None and (best is None or disruption(subset, take, priority) < best[0]):
                best = (disruption(subset, take, priority), take)
    if best is not None:
        return best[1]
    return _cover(deficit, order, giveable, each_gives=False) if len(order) > len(pool) else None


def select_shrinks(job: JobView, free: Resources, running: Sequence[JobView]) -> dict[str, int] | None:
    """New targets (job id -> dp) that free room for `job`'s minimum gang on top of `free`; {} when it
    fits already; None when shrinking every job that may shrink would not free enough."""
    cands = [j for j in running if j.elastic and j.priority <= job.priority]
    give = {j.id: max(0, j.target - j.dp_min) for j in cands}
    take = _choose(_deficit(job.demand(job.gang), free), cands, give, job.priority)
    if take is None:
        return None
    targets = by_id(cands)
    return {jid: targets[jid].target - n for jid, n in take.items()}


def select_preemptions(job: JobView, free: Resources, running: Sequence[JobView]) -> list[str] | None:
    """Kill-based preemption (the baseline): whole lower-priority jobs to stop, the fewest and lowest."""
    cands = [j for j in running if j.priority < job.priority]
    take = _choose(_deficit(job.demand(job.gang), free), cands, {j.id: j.held for j in cands}, job.priority)
    if take is None:
        return None
    return sorted(take)


# ----------------------------------------------------------------------------- growth
def plan_growth(free: Resources, jobs: Sequence[JobView], weights: Mapping[str, float],
                quotas: QuotaPolicy | None = None, usage: Mapping[str, OwnerUsage] | None = None) -> dict[str, int]:
    """New targets for jobs that grow into `free`: one replica at a time to the highest priority, then the
    owner with the least workers per unit of weight, then the job furthest below its dp.max, then the
    oldest. Owners' max_workers quotas hold."""
    quotas = quotas or QuotaPolicy()
    workers: dict[str, int] = {}
    if usage is None:  # what the jobs hold
        for j in jobs:
            workers[j.owner] = workers.get(j.owner, 0) + j.held * j.workers_per_replica
    else:
        workers = {o: u.workers for o, u in usage.items()}
    for j in jobs:
        workers.setdefault(j.owner, 0)
    targets = {j.id: j.target for j in jobs}
    free = dict(free)

    def cost(j: JobView) -> Resources:  # a shrink in progress takes back a replica it still holds for free
        return {} if targets[j.id] + 1 <= j.dp else j.replica

    def can_grow(j: JobView) -> bool:
        cap = quotas.for_owner(j.owner).max_workers
        return (targets[j.id] < j.dp_max and covers(free, cost(j))
                and (cap is None or workers[j.owner] + j.workers_per_replica <= cap))

    while True:
        grow = [j for j in jobs if can_grow(j)]
        if not grow:
            break
        j = min(grow, key=lambda j: (-j.priority, workers[j.owner] / max(weights.get(j.owner, 1.0), 1e-9),
                                     targets[j.id] / j.dp_max, j.seq))
        free = sub(free, cost(j))
        targets[j.id] += 1
        workers[j.owner] += j.workers_per_replica
    return {jid: t for jid, t in targets.items() if t != by_id(jobs)[jid].target}


# ----------------------------------------------------------------------------- one pass
def plan(s: Snapshot, mode: Mode = "shrink", *, freed_by: str | None = None, grow: bool = True) -> Plan:
    """One scheduling pass over the snapshot (see the module's docstring). `freed_by` names what freed
    capacity since the last pass (for the growth events' reason); grow=False holds growth this pass
    (capacity is still being released: growing into part of it would resize twice)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} must be one of {MODES}")
    queued = by_id(s.queued)
    adm = plan_admission([j.queued_job() for j in s.queued], s.free, s.total, s.usage(), s.quotas)
    out = Plan(waiting=dict(adm.waiting))
    free = dict(s.free)
    started: list[JobView] = []
    for jid in adm.admit:
        j = queued[jid]
        free = sub(free, j.demand(j.gang))
        out.admit[jid] = j.dp_min
        started.append(JobView(j.id, j.owner, j.priority, j.seq, j.replica, j.workers_per_replica, j.dp_min,
                               j.dp_max, dp=0, target=j.dp_min, spares=j.spares))
    if adm.blocked is not None:  # the capacity that frees up is this job's: nothing grows meanwhile
        job = queued[adm.blocked]
        soon = add(free, s.releasing())
        if covers(soon, job.demand(job.gang)):
            out.waiting[job.id] = "waiting for running jobs to finish shrinking"
        elif mode == "shrink":
            targets = select_shrinks(job, soon, s.running)
            if targets:
                running = by_id(s.running)
                for jid, new in sorted(targets.items()):
                    out.resizes.append(Resize(jid, running[jid].target, new, f"shrunk {running[jid].target}→{new} "
                                              f"to admit job {job.id}, priority {job.priority}"))
                out.waiting[job.id] = "waiting while " + ", ".join(f"job {j} shrinks" for j in sorted(targets))
        elif mode == "kill":
            victims = select_preemptions(job, soon, s.running)
            if victims:
                out.preempt.extend(victims)
        return out
    if not grow:
        return out
    why = f"capacity freed by job {freed_by}" if freed_by else "capacity is free"
    jobs = [*s.running, *started]
    usage = s.usage()
    for j in started:
        u = usage.setdefault(j.owner, OwnerUsage())
        u.jobs += 1
        u.workers += j.held * j.workers_per_replica
    for jid, new in sorted(plan_growth(free, jobs, s.weights, s.quotas, usage).items()):
        if jid in out.admit:
            out.admit[jid] = new  # starts bigger: no resize of a job that has not started
            continue
        old = by_id(s.running)[jid].target
        out.resizes.append(Resize(jid, old, new, f"grown {old}→{new}: {why}"))
    return out
