"""The supervisor's actor surface: the Ray actor `Supervisor` (inbox, cancel, status, events) and the
functions that launch, find and wait for it.

The actor builds the job's parts (reporter, replica pool, snapshot committer, failure detector,
generations, controller), runs the controller on a thread of its own, and turns worker notes into
updates of the shared `JobRun`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
import warnings
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from checkpointing.naming import CONTROL_RESOURCE, NAMESPACE, supervisor_name
from service import sizing
from service.policies import FailurePolicy, Policies, ScalingPolicy, StragglerPolicy
from service.supervisor.agents import SERVICE_AGENT_MISSES, SERVICE_MEMBER_MISSES, AgentTracker
from service.supervisor.committer import SnapshotCommitter
from service.supervisor.context import JobFailed, JobRun
from service.supervisor.controller import Controller, Failed
from service.supervisor.detection import FailureDetector
from service.supervisor.generations import Generations
from service.supervisor.pool import ReplicaPool, ReplicaState
from service.supervisor.reporter import Reporter
from workers.protocol import CheckpointReport, FaultNote, Formed, Heartbeat, NodeBatch, Note, SnapshotAck

_LINGER_S = 600.0  # without a store, stay readable this long after the end (or until shutdown())


def policies_for(spec: Any, dp_min: int, dp_max: int) -> Policies:
    """The rules a job's spec asks for."""
    ft = spec.fault_tolerance
    return Policies(failures=FailurePolicy(ft.max_recoveries), scaling=ScalingPolicy(dp_min, dp_max),
                    stragglers=StragglerPolicy(ft.straggler_factor, ft.straggler_action))


class Supervisor:
    def __init__(self, job_id: str, spec_json: str, store_url: str | None, namespace: str = NAMESPACE,
                 target_dp: int | None = None) -> None:
        from service.spec import JobSpec
        from workers.log_capture import capture_process_output, echo_logs_to_stdout

        output = capture_process_output()  # this actor is the job's: its output goes to the job's logs
        echo_logs_to_stdout()
        spec = JobSpec.model_validate_json(spec_json)
        store: Any = None
        if store_url:
            from service.store import JobStore
            from service.supervisor.store_writer import ATTEMPT_RETRY_S

            # One attempt's retry budget: the store writer retries for as long as the job lives.
            store = JobStore(store_url, run_migrations=False, write_retry_s=ATTEMPT_RETRY_S)
        ctx = ray.get_runtime_context()
        with warnings.catch_warnings():  # Ray's own property uses its deprecated actor_id inside
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = bool(ctx.was_current_actor_reconstructed)
        from pathlib import Path

        per_worker = sizing.worker_resources(spec)
        mp = sizing.model_parallel_size(spec)
        dp_min, dp_max = sizing.dp_range(spec)
        self.run = JobRun(
            job_id=job_id, spec=spec, namespace=namespace, store=store, restarted=restarted,
            self_handle=ctx.current_actor, mp=mp, cp_tp=spec.parallelism.cp * spec.parallelism.tp,
            per_worker=per_worker, dp_min=dp_min,
            dp_max=dp_max if dp_max is not None else max(dp_min, _fill_dp(per_worker, mp)),
            output_dir=Path(spec.training.output_dir).expanduser().resolve(),
        )
        self.policies = policies_for(spec, self.run.dp_min, self.run.dp_max)
        self.reporter = Reporter(self.run, output)
        self.pool = ReplicaPool(self.run, self.reporter)
        self.committer = SnapshotCommitter(self.run, self.reporter)
        self.agents = AgentTracker(self.run, self.committer.on_ack, self.report, self.reporter.add_logs,
                                   self.reporter.event, misses=SERVICE_AGENT_MISSES,
                                   member_misses=SERVICE_MEMBER_MISSES)
        detector = FailureDetector(self.run, self.reporter, self.policies.stragglers)
        self.generations = Generations(self.run, self.reporter, self.pool, self.committer, detector,
                                       self.policies.scaling, self.agents)
        if target_dp is not None:  # the scheduler's start size (dp.max when it leaves it open)
            self.generations.set_target(max(self.run.dp_min, min(self.run.dp_max, target_dp)), "")
        self.controller = Controller(self.run, self.reporter, self.pool, self.committer, self.generations,
                                     self.policies)
        self._thread = threading.Thread(target=self._main, name="supervisor", daemon=True)
        self._thread.start()

    # ================================================================= the actor's public calls
    def report(self, note: Note) -> None:
        """Heartbeats and notes from workers (workers.protocol; fire and forget). Any note shows its
        worker alive."""
        now = time.time()
        run = self.run
        if isinstance(note, NodeBatch):  # a node agent's batch: its ranks' notes folded (agents.py)
            with run.lock:
                self.agents.on_batch(note, now)
            return
        with run.lock:
            if note.logs:
                self.reporter.add_logs(note.source, note.logs)
                note.logs = []
            run.hb[note.worker] = (now, note)
            if isinstance(note, Heartbeat):  # its snapshot acks (a worker without a node agent)
                for ack in note.acks:
                    self.committer.on_ack(ack.generation, ack.step, ack.rank, ack.world_size, ack.ok, ack.acked)
            match note:
                case FaultNote():
                    run.faults.append(note)
                case Formed() if note.generation == run.generation:
                    run.formed[note.worker] = note
                case CheckpointReport():
                    self.reporter.on_checkpoint(note)
                case SnapshotAck():
                    self.committer.on_ack(note.generation, note.step, note.rank, note.world_size, note.ok,
                                          note.acked)
                case Heartbeat(last=last) if last is not None and note.generation == run.generation:
                    rep = run.step_reports.setdefault(note.step, {"gap": {}, "time": {}})
                    rep["gap"][note.worker] = last.gap_s
                    rep["time"][note.worker] = last.step_time_s
                    if note.metrics is not None:
                        run.pending_rows[note.step] = self.generations.spares.in_row(note.metrics)
                        run.last_step_seen = max(run.last_step_seen, note.step)
                case _:
                    pass  # fencing: notes of an old generation are ignored

    def cancel(self) -> None:
        self.run.cancel.set()

    def resize_to(self, dp: int, reason: str = "") -> dict[str, Any]:
        """Run at data-parallel degree `dp` from the next snapshot boundary on (the scheduler's call):
        smaller, the generation pauses there and re-forms without its last replicas; bigger, replicas are
        reserved and join at a pause once ready. No step is lost either way. The same target again is a
        no-op. ValueError outside resources.dp."""
        gens = self.generations
        with self.run.lock:
            before = gens.target
            if before != dp:  # the same target again (the scheduler re-sends it) keeps its reason
                gens.set_target(int(dp), reason)
            current = self.run.dp
        if before != dp:
            self.reporter.event("resize_requested", f"asked to run at dp={dp} (now {current})"
                                + (f": {reason}" if reason else ""), dp=current, target_dp=dp, reason=reason or None)
        return {"dp": current, "target_dp": dp}

    def shutdown(self) -> None:
        """Let a finished supervisor exit now (the `unbroken run` path calls this once it has read all)."""
        self.run.shutdown.set()

    def status(self) -> dict[str, Any]:
        run = self.run
        with run.lock:
            return {
                "job_id": run.job_id, "state": run.sm.state.value, "generation": run.generation,
                "dp": run.dp, "target_dp": self.generations.target, "world_size": run.dp * run.mp, "step": self.reporter.last_row_step,
                "total_steps": run.spec.training.steps, "recoveries": run.recoveries, "reason": run.reason,
                "done": run.done.is_set(),
                "workers": [s.name for r in self.pool.replicas.values() for s in r.slots
                            if r.state == ReplicaState.ACTIVE],
                "restarted": run.restarted, "last_metrics": self.reporter.last_row,
                "output_dir": str(run.output_dir),
            }

    def events(self, after: int = 0) -> list[dict[str, Any]]:
        with self.run.lock:
            return [dict(e) for e in self.reporter.events[after:]]

    # ================================================================= the main thread
    def _main(self) -> None:
        try:
            from service.job_paths import FolderTaken, claim_folder

            try:
                claim_folder(self.run.output_dir, self.run.job_id)
            except FolderTaken as e:
                raise JobFailed(str(e)) from None
            self.reporter.open_outputs()
        except JobFailed as e:
            self.controller.state = Failed(str(e))
        except Exception as e:  # noqa: BLE001 - the job fails with the reason; the actor stays to say so
            self.controller.state = Failed(f"supervisor error: {type(e).__name__}: {e}", traceback.format_exc())
        try:
            self.controller.run_to_end()
        finally:
            with contextlib.suppress(Exception):
                self.reporter.flush_metrics(force=True)
                self.reporter.recoveries.settle()
            self._release_all()
            self.reporter.flush_logs()
            self.reporter.close_outputs()
            self.run.done.set()
            self._exit()

    def _release_all(self) -> None:
        """Workers, placement groups, scratch snapshots and keeper memory of the job: all go."""
        self.pool.release_all()
        freed = self.committer.drop_job()
        self.reporter.event("released", f"workers, placement groups and {freed} bytes of keeper memory released",
                            keeper_bytes=freed)

    def _exit(self) -> None:
        self.run.shutdown.wait(_LINGER_S if self.run.store is None else 1.0)
        with contextlib.suppress(Exception):
            ray.kill(self.run.self_handle, no_restart=True)


def _fill_dp(per_worker: dict[str, float], mp: int) -> int:
    """The replicas the whole cluster holds (dp.max when the spec leaves it open)."""
    total = ray.cluster_resources()
    per = per_worker or {"CPU": 1.0}
    fits = min(int(total.get(k, 0.0) // (v * mp)) for k, v in per.items() if v)
    return max(1, fits)


# ===================================================================== the agreed entry points
def launch_supervisor(job_id: str, spec: Any, *, store_url: str | None, namespace: str = NAMESPACE,
                      target_dp: int | None = None) -> Any:
    """Create the detached named actor `job-<id>/supervisor`, which runs the job; returns its handle.
    `target_dp`: the dp to start at (the scheduler's choice); None: as large as dp.max allows."""
    from service.store import spec_to_private_json

    resources: dict[str, float] = {}
    with contextlib.suppress(Exception):
        # Supervisors go to nodes meant for the control path where the cluster has some (the KubeRay
        # manifests' cpu group, our local clusters' head).
        if ray.cluster_resources().get(CONTROL_RESOURCE):
            resources[CONTROL_RESOURCE] = 0.001  # keep the supervisor off nodes that may be lost
    cls = ray.remote(Supervisor)
    return cls.options(
        name=supervisor_name(job_id), namespace=namespace, lifetime="detached",
        max_restarts=spec.fault_tolerance.supervisor_max_restarts, max_task_retries=0,
        max_concurrency=16, num_cpus=0, resources=resources or None,
    ).remote(job_id, spec_to_private_json(spec), store_url, namespace, target_dp)


def find_supervisor(job_id: str, namespace: str = NAMESPACE) -> Any | None:
    """The handle of a job's supervisor, or None when it does not exist (any more)."""
    try:
        return ray.get_actor(supervisor_name(job_id), namespace=namespace)
    except ValueError:
        return None


def wait_done(handle: Any, timeout_s: float) -> dict[str, Any]:
    """Poll `status` until the job is done (for tests and the CLI); returns the last status."""
    deadline = time.monotonic() + timeout_s
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            st = ray.get(handle.status.remote(), timeout=10)
        except GetTimeoutError:
            continue
        if st.get("done"):
            return st
        time.sleep(0.2)
    raise TimeoutError(f"job {st.get('job_id')} not done after {timeout_s:g}s: {st}")
