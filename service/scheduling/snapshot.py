"""What the scheduling policies see: the cluster's resources and every job as a count of data-parallel
replicas. Plain frozen data (no Ray, no store), so the live scheduler and the simulator build the same
snapshot and run the same policies on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from service.scheduling.admission import OwnerUsage, QueuedJob, QuotaPolicy

Resources = dict[str, float]
DEFAULT_WEIGHT = 1.0


def scaled(res: Mapping[str, float], n: float) -> Resources:
    return {k: v * n for k, v in res.items()}


def add(a: Mapping[str, float], b: Mapping[str, float]) -> Resources:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in set(a) | set(b)}


def sub(a: Mapping[str, float], b: Mapping[str, float]) -> Resources:
    return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in set(a) | set(b)}


def covers(have: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(have.get(k, 0.0) + 1e-9 >= v for k, v in need.items())


@dataclass(frozen=True)
class JobView:
    """One job for the policies. A queued job has dp = target = 0.

    `dp` is what it runs at now (as its supervisor last reported), `target` what the scheduler last
    asked of it; until a resize is done the job holds max(dp, target) replicas.
    """

    id: str
    owner: str
    priority: int
    seq: int
    replica: Resources  # Ray resources of one data-parallel replica (tp x pp x cp workers)
    workers_per_replica: int
    dp_min: int
    dp_max: int
    dp: int = 0
    target: int = 0
    spares: int = 0  # warm spare replicas it keeps beside its group (service.sizing.spare_replicas)

    @property
    def elastic(self) -> bool:
        return self.dp_max > self.dp_min

    @property
    def held(self) -> int:
        """Replicas counted as taken: a shrinking job frees its surplus only once its resize is done; its
        spares are held all along."""
        return max(self.dp, self.target) + self.spares

    @property
    def gang(self) -> int:
        """Replicas it needs to start: its minimum gang and its spares."""
        return self.dp_min + self.spares

    @property
    def releasing(self) -> int:
        """Replicas a shrink asked for that are not free yet."""
        return max(0, self.dp - self.target)

    def demand(self, dp: int) -> Resources:
        return scaled(self.replica, dp)

    def queued_job(self) -> QueuedJob:
        return QueuedJob(self.id, self.owner, self.priority, self.seq, self.gang * self.workers_per_replica,
                         self.demand(self.gang))


@dataclass(frozen=True)
class Snapshot:
    total: Resources
    free: Resources  # free now (Ray's view and our own count, whichever is smaller)
    running: tuple[JobView, ...] = ()
    queued: tuple[JobView, ...] = ()
    weights: Mapping[str, float] = field(default_factory=dict)  # owner -> fair-share weight
    quotas: QuotaPolicy = field(default_factory=QuotaPolicy)

    def weight(self, owner: str) -> float:
        return float(self.weights.get(owner, DEFAULT_WEIGHT))

    def usage(self) -> dict[str, OwnerUsage]:
        """Admitted jobs and workers by owner (what the quotas count)."""
        out: dict[str, OwnerUsage] = {}
        for j in self.running:
            u = out.setdefault(j.owner, OwnerUsage())
            u.jobs += 1
            u.workers += j.held * j.workers_per_replica
        return out

    def releasing(self) -> Resources:
        """Capacity that shrinks already asked for will free."""
        out: Resources = {}
        for j in self.running:
            out = add(out, j.demand(j.releasing))
        return out


def by_id(jobs: Iterable[JobView]) -> dict[str, JobView]:
    return {j.id: j for j in jobs}
