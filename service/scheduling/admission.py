"""Gang admission within per-owner quotas: which queued jobs start now (pure; no Ray, no store).

Order: priority (high first), then submission (FIFO). A job starts only if its whole minimum gang fits
what is free. The elastic policies (service.scheduling.policies) decide what to shrink when it does
not, and what to grow when capacity is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from service import sizing


@dataclass(frozen=True)
class Quota:
    """Limits on one owner's admitted, unfinished jobs. None: no limit."""

    max_running_jobs: int | None = None
    max_workers: int | None = None


@dataclass(frozen=True)
class QuotaPolicy:
    default: Quota = field(default_factory=Quota)
    per_owner: dict[str, Quota] = field(default_factory=dict)

    def for_owner(self, owner: str) -> Quota:
        return self.per_owner.get(owner, self.default)


@dataclass(frozen=True)
class QueuedJob:
    """What admission needs to know about one waiting job."""

    id: str
    owner: str
    priority: int
    seq: int  # submission order
    workers: int  # the minimum gang
    demand: dict[str, float]  # Ray resources of the whole minimum gang


@dataclass
class OwnerUsage:
    jobs: int = 0
    workers: int = 0


@dataclass(frozen=True)
class Admission:
    admit: list[str]
    waiting: dict[str, str]  # job id -> why it waits
    blocked: str | None = None  # the first job that fits the cluster but not what is free now


def plan_admission(
    queue: Sequence[QueuedJob],
    free: dict[str, float],
    total: dict[str, float],
    usage: dict[str, OwnerUsage],
    quotas: QuotaPolicy,
) -> Admission:
    """Which queued jobs to start now.

    Order: priority (high first), then submission (FIFO). A job starts only if its whole minimum
    gang fits in `free` (all or nothing). A job that fits the cluster but not what is free now
    blocks every job behind it, so large jobs are not starved by a stream of small ones. A job
    over its owner's quota, or larger than the whole cluster as it is now, waits without
    blocking the others.
    """
    free = dict(free)
    usage = {k: OwnerUsage(v.jobs, v.workers) for k, v in usage.items()}
    admit: list[str] = []
    waiting: dict[str, str] = {}
    blocker: QueuedJob | None = None
    for job in sorted(queue, key=lambda j: (-j.priority, j.seq)):
        q = quotas.for_owner(job.owner)
        u = usage.setdefault(job.owner, OwnerUsage())
        if q.max_running_jobs is not None and u.jobs + 1 > q.max_running_jobs:
            waiting[job.id] = f"owner {job.owner!r} is at its quota of {q.max_running_jobs} running jobs"
            continue
        if q.max_workers is not None and u.workers + job.workers > q.max_workers:
            waiting[job.id] = (
                f"owner {job.owner!r} would use {u.workers + job.workers} workers, over its quota of "
                f"{q.max_workers}"
            )
            continue
        if not sizing.fits(job.demand, total):
            waiting[job.id] = f"needs {_fmt(job.demand)} but the whole cluster has {_fmt(total, job.demand)}"
            continue
        if blocker is not None:
            waiting[job.id] = f"queued behind job {blocker.id} (priority {blocker.priority})"
            continue
        if sizing.fits(job.demand, free):
            admit.append(job.id)
            for k, v in job.demand.items():
                free[k] = free.get(k, 0.0) - v
            u.jobs += 1
            u.workers += job.workers
        else:
            waiting[job.id] = f"waiting for {_fmt(job.demand)}; free now: {_fmt(free, job.demand)}"
            blocker = job
    return Admission(admit, waiting, blocker.id if blocker is not None else None)


def _fmt(res: dict[str, float], keys: dict[str, float] | None = None) -> str:
    names = sorted(keys if keys is not None else res)
    return ", ".join(f"{res.get(k, 0.0):g} {k}" for k in names) or "nothing"
