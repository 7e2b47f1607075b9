"""The scheduler: a queue of PENDING jobs, admitted in priority then FIFO order when the
cluster can hold a job's whole minimum gang, within per-owner quotas.

Admitting a job starts its supervisor (service.supervisor.launch_supervisor), a detached named
Ray actor that runs the job and reports through the JobStore. On start the scheduler reconciles
with what survived a restart: jobs whose supervisor is alive are adopted, the others are failed.

`plan_admission` is the pure policy (tested on its own); `Scheduler` wires it to the store and Ray.
Ray and the supervisor module are imported inside functions: the API can run without them
("store only" mode, where no scheduler exists and jobs stay PENDING).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from service import sizing
from service.statuses import CANCELLED, FAILED, PENDING
from service.store import JobRecord, JobStore

log = logging.getLogger(__name__)


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
    return Admission(admit, waiting)


def _fmt(res: dict[str, float], keys: dict[str, float] | None = None) -> str:
    names = sorted(keys if keys is not None else res)
    return ", ".join(f"{res.get(k, 0.0):g} {k}" for k in names) or "nothing"


def queued_job(rec: JobRecord, spec: Any) -> QueuedJob:
    return QueuedJob(rec.id, rec.owner, rec.priority, rec.seq, rec.min_world, sizing.gang_demand(spec))


_UNKNOWN: Any = object()  # "Ray could not tell": never a reason to fail a job


class RayCluster:
    """The live cluster's resources, read from the connected Ray driver."""

    def available(self) -> dict[str, float]:
        import ray

        return {k: float(v) for k, v in ray.available_resources().items()}

    def total(self) -> dict[str, float]:
        import ray

        return {k: float(v) for k, v in ray.cluster_resources().items()}


def _launch_supervisor(job_id: str, spec: Any, store_url: str | None, namespace: str) -> Any:
    from service.supervisor import launch_supervisor

    return launch_supervisor(job_id, spec, store_url=store_url, namespace=namespace)


def _find_supervisor(job_id: str, namespace: str) -> Any:
    from service.supervisor import find_supervisor

    try:
        return find_supervisor(job_id, namespace=namespace)
    except TypeError:  # a find_supervisor(job_id) without the namespace keyword
        return find_supervisor(job_id)


class Scheduler:
    """Admits queued jobs in a background thread; cancels and reconciles jobs for the API."""

    def __init__(
        self,
        store: JobStore,
        *,
        store_url: str | None = None,
        namespace: str = "unbroken",
        quotas: QuotaPolicy | None = None,
        cluster: RayCluster | None = None,
        interval_s: float = 1.0,
        liveness_every_s: float = 5.0,
        runs_root: str | None = None,
    ) -> None:
        from service.auth import unbroken_home

        self.store = store
        self.runs_root = runs_root or str(unbroken_home() / "runs")  # each job's folder: <runs_root>/<job-id>
        self.store_url = store_url if store_url is not None else store.url
        self.namespace = namespace
        self.quotas = quotas or QuotaPolicy()
        self.cluster = cluster or RayCluster()
        self.interval_s = interval_s
        self.liveness_every_s = liveness_every_s
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Several API processes may share one PostgreSQL store: only the holder of this lease admits,
        # reconciles and checks liveness; the others serve requests and wait to take over.
        self._lease = store.leader_lease()
        self.leading = False
        self._last_wait_reason: dict[str, str] = {}
        self._last_liveness = 0.0
        self.handles: dict[str, Any] = {}

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._lease.hold():
            self.leading = True
            self.reconcile()
        self._thread = threading.Thread(target=self._loop, name="unbroken-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._lease.release()
        self.leading = False

    def notify(self) -> None:
        """Something changed (a submit, a finish): run an admission pass soon."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self._lease.hold():
                    if not self.leading:
                        log.warning("this scheduler now leads (took the leader lease); reconciling")
                        self.leading = True
                        self.reconcile()
                    self.tick()
                elif self.leading:
                    log.warning("this scheduler lost the leader lease; it stops admitting")
                    self.leading = False
            except Exception:  # keep scheduling: one bad pass must not stop the queue
                log.exception("scheduler pass failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    # ---- the cluster as the API sees it --------------------------------------------------------

    def cluster_total(self) -> dict[str, float] | None:
        try:
            return self.cluster.total()
        except Exception:
            log.exception("could not read the cluster's resources")
            return None

    # ---- admission -----------------------------------------------------------------------------

    def tick(self) -> list[str]:
        """One admission pass; returns the ids of the jobs started."""
        with self._lock:
            if time.monotonic() - self._last_liveness >= self.liveness_every_s:
                self._last_liveness = time.monotonic()
                self.check_liveness()
            queue_recs = self.store.queued_jobs()
            if not queue_recs:
                return []
            active = self.store.admitted_jobs()
            usage: dict[str, OwnerUsage] = {}
            reserved: dict[str, float] = {}
            for rec in active:
                u = usage.setdefault(rec.owner, OwnerUsage())
                workers = max(rec.min_world, int((rec.progress or {}).get("world_size") or 0))
                u.jobs += 1
                u.workers += workers
                for k, v in sizing.gang_demand(_spec_of(rec), workers).items():
                    reserved[k] = reserved.get(k, 0.0) + v
            total = self.cluster.total()
            available = self.cluster.available()
            # Ray's free count lags a just-started job's reservation; our own count misses other users.
            free = {k: min(available.get(k, 0.0), total.get(k, 0.0) - reserved.get(k, 0.0)) for k in total}
            specs = {rec.id: self.store.get_spec(rec.id) for rec in queue_recs}
            plan = plan_admission(
                [queued_job(r, specs[r.id]) for r in queue_recs], free, total, usage, self.quotas
            )
            for job_id, why in plan.waiting.items():
                if self._last_wait_reason.get(job_id) != why:
                    self._last_wait_reason[job_id] = why
                    self.store.add_event(job_id, "waiting", why)
            started = []
            for job_id in plan.admit:
                self._last_wait_reason.pop(job_id, None)
                if self._admit(job_id, specs[job_id]):
                    started.append(job_id)
            return started

    def _admit(self, job_id: str, spec: Any) -> bool:
        if not self.store.mark_admitted(job_id):
            return False  # cancelled meanwhile
        try:
            from service.job_paths import resolve_job_paths

            spec = resolve_job_paths(spec, job_id, self.runs_root)
            handle = _launch_supervisor(job_id, spec, self.store_url, self.namespace)
        except Exception as e:
            log.exception("could not start the supervisor of job %s", job_id)
            self.store.set_status(job_id, FAILED, f"could not start the job's supervisor: {e}")
            return False
        self.handles[job_id] = handle
        self.store.add_event(job_id, "supervisor_started", f"supervisor job-{job_id}/supervisor started")
        return True

    # ---- cancellation --------------------------------------------------------------------------

    def cancel(self, job_id: str) -> JobRecord:
        """Ask a job to stop: a queued job is cancelled at once, a running one through its supervisor."""
        with self._lock:
            job = self.store.request_cancel(job_id)
            if job.terminal:
                return job
            if job.admitted_at is None and job.status == PENDING:
                self.store.set_status(job_id, CANCELLED, "cancelled before it started")
            else:
                handle = self._supervisor(job_id)
                if handle is None:
                    self.store.set_status(job_id, CANCELLED, "cancelled; its supervisor was already gone")
                elif handle is not _UNKNOWN:
                    handle.cancel.remote()
                # else: the request is recorded; reconcile() re-sends it when Ray answers again.
            got = self.store.get_job(job_id)
            assert got is not None
            return got

    def _supervisor(self, job_id: str) -> Any:
        """The job's supervisor handle, None if it does not exist, or _UNKNOWN if Ray could not say."""
        try:
            return _find_supervisor(job_id, self.namespace)
        except Exception:
            log.exception("looking up the supervisor of job %s failed", job_id)
            return _UNKNOWN

    # ---- restart and liveness ------------------------------------------------------------------

    def reconcile(self) -> dict[str, str]:
        """After a (re)start: adopt jobs whose supervisor lives, fail those whose supervisor is gone."""
        outcome: dict[str, str] = {}
        with self._lock:
            for rec in self.store.admitted_jobs():
                handle = self._supervisor(rec.id)
                if handle is _UNKNOWN:
                    outcome[rec.id] = "unknown"  # Ray did not answer: decide on a later liveness pass
                    continue
                if handle is None:
                    self.store.set_status(
                        rec.id, FAILED, "its supervisor was gone when the control plane restarted"
                    )
                    outcome[rec.id] = "failed"
                    continue
                self.handles[rec.id] = handle
                self.store.add_event(rec.id, "adopted", "the restarted control plane found its supervisor alive")
                if rec.cancel_requested:
                    handle.cancel.remote()
                outcome[rec.id] = "adopted"
        return outcome

    def check_liveness(self) -> list[str]:
        """Fail admitted, unfinished jobs whose supervisor actor no longer exists."""
        lost = []
        for rec in self.store.admitted_jobs():
            handle = self._supervisor(rec.id)
            if handle is not None and handle is not _UNKNOWN and rec.cancel_requested:
                handle.cancel.remote()  # a cancel that could not be delivered before
            if handle is None:
                fresh = self.store.get_job(rec.id)
                if fresh is not None and not fresh.terminal:
                    self.store.set_status(rec.id, FAILED, "its supervisor actor died")
                    lost.append(rec.id)
                self.handles.pop(rec.id, None)
        return lost


def _spec_of(rec: JobRecord) -> Any:
    from service.spec import JobSpec

    if rec.spec is None:
        raise ValueError(f"job {rec.id}: read with its spec (JobStore.admitted_jobs does)")
    return JobSpec.model_validate(rec.spec)
