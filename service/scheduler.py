"""The scheduler: a queue of PENDING jobs, admitted in priority then FIFO order when the
cluster can hold a job's whole minimum gang, within per-owner quotas.

Admitting a job starts its supervisor (service.supervisor.launch_supervisor), a detached named
Ray actor that runs the job and reports through the JobStore. On start the scheduler reconciles
with what survived a restart: jobs whose supervisor is alive are adopted, the others are failed.

Each pass is service.scheduling.policies.plan over a snapshot of the store and the cluster (pure, tested
on its own, and what the simulator runs): admission, shrinking lower-priority elastic jobs for the first
job that waits for capacity (the supervisors' resize_to), growth into free capacity by priority then
weighted fair share. Every decision is an event of the job with its reason; each job's target dp is
kept in the store. `Scheduler` wires the plan to the store, the supervisors and Ray's autoscaler.
Ray and the supervisor module are imported inside functions: the API can run without them
("store only" mode, where no scheduler exists and jobs stay PENDING).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from service import sizing
from service.scheduling import autoscaler, policies
from service.scheduling.admission import (  # noqa: F401 - the scheduler's policy names, re-exported
    Admission,
    OwnerUsage,
    QueuedJob,
    Quota,
    QuotaPolicy,
    plan_admission,
)
from service.scheduling.snapshot import JobView, Snapshot, add
from service.statuses import CANCELLED, FAILED, PENDING
from service.store import JobNotFoundError, JobRecord, JobStore

log = logging.getLogger(__name__)

GROW_SETTLE_S = 10.0  # how long growth waits for an ended job's workers to be released by Ray


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


def still_releasing(available: dict[str, float], total: dict[str, float], reserved: dict[str, float]) -> bool:
    """Whether Ray still counts as held some of what the running jobs do not hold (an ended job's workers
    not yet gone). Only the kinds jobs hold are compared: Ray's object_store_memory, for one, is below its
    total whenever any object is stored, which made growth always wait GROW_SETTLE_S."""
    return any(available.get(k, 0.0) + 1e-9 < total.get(k, 0.0) - held for k, held in reserved.items())


def _launch_supervisor(job_id: str, spec: Any, store_url: str | None, namespace: str,
                       target_dp: int | None = None) -> Any:
    from service.supervisor import launch_supervisor

    return launch_supervisor(job_id, spec, store_url=store_url, namespace=namespace, target_dp=target_dp)


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
        self._unreadable_ids: set[str] = set()  # admitted jobs whose stored spec does not validate (told once)
        self._last_liveness = 0.0
        self.handles: dict[str, Any] = {}
        self._active_ids: set[str] = set()
        self._freed_by: str | None = None
        self._ended_at = -1e18  # monotonic time the last admitted job ended
        self.decisions: Counter[str] = Counter()  # admit / shrink / grow: exported as a Prometheus counter
        self.demand = autoscaler.DemandRequest()  # queued demand, asked of Ray's autoscaler

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
        """One scheduling pass (service.scheduling.policies.plan): admit what fits, shrink lower-priority
        elastic jobs for the first job that waits for capacity, grow running jobs into free capacity.
        Each decision is recorded as an event with its reason. Returns the ids of the jobs started."""
        with self._lock:
            if time.monotonic() - self._last_liveness >= self.liveness_every_s:
                self._last_liveness = time.monotonic()
                self.check_liveness()
            queue_recs = self.store.queued_jobs()
            active = self.store.admitted_jobs()
            ids = {rec.id for rec in active}
            for gone in sorted(self._active_ids - ids):
                self._freed_by = gone  # the last job that ended: what growth names as the cause
                self._ended_at = time.monotonic()
            self._active_ids = ids
            if not queue_recs and not active:
                self.demand.update([])
                return []  # an idle store: no Ray call
            specs = self._readable(active, _spec_of)
            active = [rec for rec in active if rec.id in specs]
            total = self.cluster.total()
            running = [running_view(rec, specs[rec.id], total) for rec in active]
            if not queue_recs and not any(j.target < j.dp_max for j in running):
                if not any(j.dp == 0 for j in running):  # held while a job admitted onto new nodes starts
                    self.demand.update([])
                return []
            queued_specs = self._readable(queue_recs, lambda rec: self.store.get_spec(rec.id))
            queue_recs = [rec for rec in queue_recs if rec.id in queued_specs]
            specs.update(queued_specs)
            reserved: dict[str, float] = {}
            for j in running:
                reserved = add(reserved, j.demand(j.held))
            available = self.cluster.available()
            # Ray's free count lags a just-started job's reservation; our own count misses other users.
            free = {k: min(available.get(k, 0.0), total.get(k, 0.0) - reserved.get(k, 0.0)) for k in total}
            snap = Snapshot(total, free, tuple(running),
                            tuple(queued_view(r, specs[r.id], total) for r in queue_recs),
                            self.store.owner_weights(), self.quotas)
            # A job that just ended frees its workers one by one; Ray's count trails ours meanwhile. Growth
            # waits for it (a while: other users' tasks also hold what we do not count).
            settling = still_releasing(available, total, reserved) and time.monotonic() - self._ended_at < GROW_SETTLE_S
            plan = policies.plan(snap, "shrink", freed_by=self._freed_by, grow=not settling)
            for job_id, why in plan.waiting.items():
                if self._last_wait_reason.get(job_id) != why:
                    self._last_wait_reason[job_id] = why
                    self.store.add_event(job_id, "waiting", why)
            for r in plan.resizes:
                self._resize(r)
            if any(r.kind == "grow" for r in plan.resizes):
                self._freed_by = None
            started = []
            for job_id, dp in plan.admit.items():
                self._last_wait_reason.pop(job_id, None)
                if self._admit(job_id, specs[job_id], dp):
                    started.append(job_id)
            self.demand.update(autoscaler.queued_demand(snap, plan))
            return started

    def _readable(self, recs: list[JobRecord], read: Callable[[JobRecord], Any]) -> dict[str, Any]:
        """{job id: spec} of the jobs whose stored spec reads. A spec stored by an older version may not
        validate under this one's rules: that job, not the whole pass, is set aside (`_unreadable`). A job
        deleted since it was listed is left out."""
        from pydantic import ValidationError

        from parallel.config import format_validation_error

        specs: dict[str, Any] = {}
        for rec in recs:
            try:
                specs[rec.id] = read(rec)
            except JobNotFoundError:
                continue
            except ValidationError as e:
                self._unreadable(rec, format_validation_error(e).replace("\n", "; "))
        return specs

    def _unreadable(self, rec: JobRecord, problems: str) -> None:
        """A queued job whose stored spec no longer validates fails, naming the fields: it could not start
        as stored. One already admitted runs on at its size (its supervisor holds the spec it started
        with), outside this scheduler's sharing; its event says so once."""
        why = f"its stored job spec does not validate under this version of Unbroken ({problems})"
        if rec.admitted_at is None and rec.status == PENDING:
            self.store.set_status(rec.id, FAILED, f"{why}: resubmit the job with those fields fixed")
        elif rec.id not in self._unreadable_ids:
            self._unreadable_ids.add(rec.id)
            self.store.add_event(rec.id, "spec_unreadable", f"{why}: it runs on at its current size, and is neither "
                                 "shrunk nor grown while the scheduler shares the cluster")

    def _resize(self, r: policies.Resize) -> None:
        """Ask a running job's supervisor to run at r.new from its next snapshot boundary on."""
        self.store.set_target_dp(r.job_id, r.new)
        self.store.add_event(r.job_id, r.kind, r.reason, {"old_dp": r.old, "new_dp": r.new})
        self.decisions[r.kind] += 1
        handle = self.handles.get(r.job_id) or self._supervisor(r.job_id)
        if handle is not None and handle is not _UNKNOWN:
            self.handles[r.job_id] = handle
            handle.resize_to.remote(r.new, r.reason)

    def _admit(self, job_id: str, spec: Any, dp: int | None = None) -> bool:
        if not self.store.mark_admitted(job_id):
            return False  # cancelled meanwhile
        self.decisions["admit"] += 1
        try:
            from service.job_paths import resolve_job_paths

            if dp is not None:
                self.store.set_target_dp(job_id, dp)
            spec = resolve_job_paths(spec, job_id, self.runs_root)
            handle = _launch_supervisor(job_id, spec, self.store_url, self.namespace, dp)
        except Exception as e:
            log.exception("could not start the supervisor of job %s", job_id)
            self.store.set_status(job_id, FAILED, f"could not start the job's supervisor: {e}")
            return False
        self.handles[job_id] = handle
        self.store.add_event(job_id, "supervisor_started", f"supervisor job-{job_id}/supervisor started"
                             + (f" at dp={dp}" if dp is not None else ""), {"target_dp": dp} if dp else None)
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
                    self._fail_lost(rec.id, "its supervisor was gone when the control plane restarted")
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
            elif handle is not None and handle is not _UNKNOWN and rec.target_dp is not None:
                handle.resize_to.remote(rec.target_dp)  # a no-op, unless its supervisor restarted since
            if handle is None:
                fresh = self.store.get_job(rec.id)
                if fresh is not None and not fresh.terminal:
                    self._fail_lost(rec.id, "its supervisor actor died")
                    lost.append(rec.id)
                self.handles.pop(rec.id, None)
        return lost

    def _fail_lost(self, job_id: str, why: str) -> None:
        """A job whose supervisor is gone for good fails with `why`, and what it left in the cluster (its
        detached workers, node agents and placement groups, its snapshots on the keepers) is released on a
        thread of its own (a keeper may be slow to answer; the pass goes on). Without the release they would
        hold the cluster's resources for good."""
        self.store.set_status(job_id, FAILED, why)

        def release() -> None:
            from service.supervisor.leftovers import release_leftovers

            try:
                got = release_leftovers(job_id, self.namespace)
            except Exception:
                log.exception("releasing what job %s left in the cluster failed", job_id)
                return
            self.store.add_event(job_id, "released", f"What its lost supervisor left in the cluster was released: "
                                 f"{got['actors and groups']} workers, node agents and placement groups, and "
                                 f"{got['keeper bytes'] / 2**20:.1f} MiB of snapshots on the keepers.", got)

        threading.Thread(target=release, name=f"release-{job_id}", daemon=True).start()


def _replica(spec: Any) -> tuple[dict[str, float], int]:
    mp = sizing.model_parallel_size(spec)
    return {k: v * mp for k, v in sizing.worker_resources(spec).items()}, mp


def _dp_bounds(spec: Any, total: dict[str, float]) -> tuple[int, int]:
    """resources.dp; an open max is what the whole cluster holds (as the supervisor fills it)."""
    dp_min, dp_max = sizing.dp_range(spec)
    if dp_max is None:
        replica, _ = _replica(spec)
        per = [int(total.get(k, 0.0) // v) for k, v in replica.items() if v > 0]
        dp_max = max(dp_min, min(per) if per else dp_min)
    return dp_min, dp_max


def queued_view(rec: JobRecord, spec: Any, total: dict[str, float]) -> JobView:
    replica, mp = _replica(spec)
    dp_min, dp_max = _dp_bounds(spec, total)
    return JobView(rec.id, rec.owner, rec.priority, rec.seq, replica, mp, dp_min, dp_max,
                   spares=sizing.spare_replicas(spec))


def running_view(rec: JobRecord, spec: Any, total: dict[str, float]) -> JobView:
    """A running job as the policies see it. Only a job with in-memory snapshots and a target the
    scheduler set is resized (a planned resize restores from memory); others are held at what they run."""
    replica, mp = _replica(spec)
    dp_min, dp_max = _dp_bounds(spec, total)
    p = rec.progress or {}
    dp = int(p["dp"]) if isinstance(p.get("dp"), int) else 0
    if rec.target_dp is None or not spec.checkpoint.in_memory_every:
        fixed = max(dp, dp_min, rec.target_dp or 0)
        return JobView(rec.id, rec.owner, rec.priority, rec.seq, replica, mp, fixed, fixed, dp=dp, target=fixed,
                       spares=sizing.spare_replicas(spec))
    return JobView(rec.id, rec.owner, rec.priority, rec.seq, replica, mp, dp_min, dp_max, dp=dp,
                   target=rec.target_dp, spares=sizing.spare_replicas(spec))


def _spec_of(rec: JobRecord) -> Any:
    from service.spec import JobSpec

    if rec.spec is None:
        raise ValueError(f"job {rec.id}: read with its spec (JobStore.admitted_jobs does)")
    return JobSpec.model_validate(rec.spec)
