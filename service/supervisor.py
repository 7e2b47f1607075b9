"""One detached, named supervisor actor per job (`job-<id>/supervisor`): it runs the job.

It reserves one placement group per data-parallel replica, starts the worker actors, hands each
its rank in generation 0, and then watches: run results (errors, actor and node death from Ray),
heartbeats (a silent worker is hung), step timings (stragglers). On a failure it recovers in
the same processes: bump the generation, stop the survivors, drop broken replicas, choose the
new dp degree (ScalingPolicy), re-form the group, restore the last committed state (resharded
to the new layout), and go on with the same data order. Replacements start in the background;
when a spare replica is ready and dp < max, the job grows at the next snapshot boundary.

It reports every transition as an event (to the job store when it has a store_url, and to an
in-actor list that `unbroken run` polls with `.events.remote(after=i)`), writes metrics.jsonl
in the job's output folder, and releases its workers, placement groups and scratch state when
the job ends. When it crashes itself, Ray restarts it (max_restarts); the new instance finds
the job's workers by name and carries on from the last committed state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from service import sizing
from service.placement import ReplicaReservation, release, release_job_groups, reserve_replica
from service.policies import FailurePolicy, ScalingPolicy, StragglerPolicy
from service.state_machine import STORE_STATUS, JobState, StateMachine
from workers import telemetry

log = logging.getLogger("unbroken.supervisor")

NAMESPACE = "unbroken"
_POLL_S = 0.05
_LINGER_S = 600.0  # without a store, stay readable this long after the end (or until shutdown())
_START_GRACE_S = 2.0
_HEARTBEAT_GAUGE_S = 1.0  # how often heartbeat ages are exported
_LOG_FLUSH_S = 0.5  # how often the job's output lines go to the store


def rank_of(replica_pos: int, local: int, dp: int, cp_tp: int) -> int:
    """The global rank of a replica's `local`-th worker, for the mesh order pp, dp, cp, tp.

    A replica is one model-parallel group (tp x pp x cp workers, placed together): its workers share
    the dp coordinate `replica_pos`; local // cp_tp is their pp stage, local % cp_tp their cp x tp place.
    """
    return (local // cp_tp) * (dp * cp_tp) + replica_pos * cp_tp + (local % cp_tp)


def supervisor_name(job_id: str) -> str:
    return f"job-{job_id}/supervisor"


def worker_name(job_id: str, n: int) -> str:
    return f"job-{job_id}/worker-{n}"


class JobFailed(RuntimeError):
    pass


@dataclass
class Slot:
    """One worker actor."""

    name: str
    handle: Any
    replica: int
    local: int
    info_ref: Any = None
    info: dict[str, Any] | None = None
    rank: int = -1
    run_ref: Any = None
    result: dict[str, Any] | None = None
    dead: str | None = None  # why, once it is known dead
    suspect_since: float | None = None


@dataclass
class Replica:
    index: int
    res: ReplicaReservation | None
    slots: list[Slot] = field(default_factory=list)
    state: str = "pending"  # pending -> starting -> ready (spare) | active ; dead
    since: float = field(default_factory=time.monotonic)


@dataclass
class Failure:
    kind: str
    slots: list[Slot]
    detail: str
    t_detect: float
    t_fault: float | None = None
    step: int | None = None


class Supervisor:
    def __init__(self, job_id: str, spec_json: str, store_url: str | None, namespace: str = NAMESPACE) -> None:
        from service.spec import JobSpec
        from workers.log_capture import capture_process_output, echo_logs_to_stdout

        self._output = capture_process_output()  # this actor is the job's: its output goes to the job's logs
        echo_logs_to_stdout()
        self.job_id = job_id
        self.spec = JobSpec.model_validate_json(spec_json)
        self.spec_json = spec_json
        self.namespace = namespace
        self.store: Any = None
        if store_url:
            from service.store import JobStore

            self.store = JobStore(store_url, run_migrations=False)
        ft = self.spec.fault_tolerance
        self.ft = ft
        self.mp = sizing.model_parallel_size(self.spec)
        p = self.spec.parallelism
        self.cp_tp = p.cp * p.tp
        self.per_worker = sizing.worker_resources(self.spec)
        dp_min, dp_max = sizing.dp_range(self.spec)
        self.dp_min = dp_min
        self.dp_max = dp_max if dp_max is not None else max(dp_min, self._fill_dp())
        self.scaling = ScalingPolicy(dp_min, self.dp_max)
        self.failures = FailurePolicy(ft.max_recoveries)
        self.stragglers = StragglerPolicy(ft.straggler_factor, ft.straggler_action)
        self.output_dir = Path(self.spec.training.output_dir).expanduser().resolve()
        self.sm = StateMachine()
        self._lock = threading.RLock()
        self._events: list[dict[str, Any]] = []
        self._hb: dict[str, tuple[float, dict[str, Any]]] = {}
        self._formed: dict[str, dict[str, Any]] = {}
        self._faults: list[dict[str, Any]] = []
        self._logs: list[tuple[float, str | None, str]] = []  # (time, source, line), flushed to the store
        self.warnings: list[str] = []
        self._logs_flushed_at = 0.0
        self._step_reports: dict[int, dict[str, dict[str, float]]] = {}
        self._pending_rows: dict[int, dict[str, Any]] = {}
        self._last_row_step = 0
        self._last_step_seen = 0
        self._cancel = threading.Event()
        self._shutdown = threading.Event()
        self._done = threading.Event()
        self.replicas: dict[int, Replica] = {}
        self._next_replica = 0
        self._next_worker = 0
        self.generation = -1
        self.dp = 0
        self.recoveries = 0
        self.reason: str | None = None
        self._recovery: dict[str, Any] | None = None
        self._pausing: int | None = None
        self._metrics_log: Any = None
        self._tb: Any = None  # workers.tensorboard.TensorBoardLog when the spec asks for it
        self._heartbeats_exported_at = 0.0
        self._last_row: dict[str, Any] | None = None
        self.keepers: dict[str, Any] = {}
        self._acks: dict[tuple[int, int], dict[str, Any]] = {}  # (generation, step) -> rank -> ok
        self.committed: tuple[int, int] | None = None  # the newest committed snapshot (generation, step)
        ctx = ray.get_runtime_context()
        with warnings.catch_warnings():  # Ray's own property uses its deprecated actor_id inside
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = bool(ctx.was_current_actor_reconstructed)
        self._self = ctx.current_actor
        self._thread = threading.Thread(target=self._main, name="supervisor", daemon=True)
        self._thread.start()

    # ================================================================= the actor's public calls
    def report(self, msg: dict[str, Any]) -> None:
        """Heartbeats and notes from workers (fire and forget)."""
        now = time.time()
        kind = msg.get("type")
        with self._lock:
            name = str(msg.get("worker"))
            lines = msg.pop("logs", None)
            if lines and self.store is not None:
                src = f"rank {msg['rank']}" if int(msg.get("rank", -1)) >= 0 else name.rsplit("/", 1)[-1]
                self._logs.extend((float(t), src, str(line)) for t, _stream, line in lines)
            self._hb[name] = (now, msg)
            gen = int(msg.get("generation", -1))
            if kind == "fault":
                self._faults.append(msg)
                return
            if kind == "formed" and gen == self.generation:
                self._formed[name] = msg
                return
            if kind == "checkpoint":
                self._on_checkpoint(msg)
                return
            if kind == "snapshot":
                if msg.get("ok"):
                    key = (gen, int(msg["step"]))
                    if self.committed is None or key > self.committed:
                        self._acks.setdefault(key, {"world": int(msg["world_size"]), "ranks": set()})[
                            "ranks"].add(int(msg["rank"]))
                else:
                    self._snapshot_errors = getattr(self, "_snapshot_errors", 0) + 1
                return
            if kind != "heartbeat" or gen != self.generation or "gap_s" not in msg:
                return  # fencing: notes of an old generation are ignored
            step = int(msg.get("step", 0))
            rep = self._step_reports.setdefault(step, {"gap": {}, "time": {}})
            rep["gap"][name] = float(msg["gap_s"])
            rep["time"][name] = float(msg["step_time_s"])
            if "metrics" in msg:
                self._pending_rows[step] = dict(msg["metrics"])
                self._last_step_seen = max(self._last_step_seen, step)

    def cancel(self) -> None:
        self._cancel.set()

    def shutdown(self) -> None:
        """Let a finished supervisor exit now (the `unbroken run` path calls this once it has read all)."""
        self._shutdown.set()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "job_id": self.job_id, "state": self.sm.state.value, "generation": self.generation,
                "dp": self.dp, "world_size": self.dp * self.mp, "step": self._last_row_step,
                "total_steps": self.spec.training.steps, "recoveries": self.recoveries, "reason": self.reason,
                "done": self._done.is_set(),
                "workers": [s.name for r in self.replicas.values() for s in r.slots if r.state == "active"],
                "restarted": self.restarted, "last_metrics": self._last_row,
                "output_dir": str(self.output_dir),
            }

    def events(self, after: int = 0) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(e) for e in self._events[after:]]

    # ================================================================= reporting
    def _event(self, kind: str, message: str, /, **data: Any) -> None:
        ev = {"id": 0, "ts": time.time(), "kind": kind, "message": message, "data": data}
        with self._lock:
            ev["id"] = len(self._events) + 1
            self._events.append(ev)
        log.info("job %s: %s: %s", self.job_id, kind, message)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.add_event(self.job_id, kind, message, data or None)

    def _to(self, state: JobState, reason: str = "") -> None:
        prev = self.sm.state
        self.sm.to(state, reason)
        self._event("state", f"{prev.value} -> {state.value}" + (f": {reason}" if reason else ""),
                    source=prev.value, target=state.value)
        if self.store is not None and (STORE_STATUS[prev] != STORE_STATUS[state] or prev == JobState.STARTING):
            with contextlib.suppress(Exception):
                self.store.set_status(self.job_id, STORE_STATUS[state], reason or None)

    def _on_checkpoint(self, msg: dict[str, Any]) -> None:
        if not msg.get("ok") and (msg.get("abandoned") or int(msg.get("generation", -1)) < self.generation):
            # Its group broke under it (a failure, reported as such): not a storage problem.
            log.info("checkpoint of step %s abandoned with generation %s: %s", msg.get("step"),
                     msg.get("generation"), msg.get("error"))
            return
        if msg.get("ok"):
            self._event("checkpointed", f"Persistent checkpoint of step {msg['step']} written to {msg.get('uri')}.",
                        step=msg["step"], uri=msg.get("uri"), tier=msg.get("tier", "persistent"))
            if self.store is not None:
                with contextlib.suppress(Exception):
                    self.store.add_checkpoint(self.job_id, int(msg["step"]), str(msg.get("uri")),
                                              str(msg.get("tier", "persistent")))
        else:
            self._event("checkpoint_failed", f"The persistent checkpoint of step {msg.get('step')} failed: "
                        f"{_first_line(msg.get('error'))}",
                        step=msg.get("step"), error=msg.get("error"))

    def _flush_logs(self) -> None:
        """The job's output lines (workers' and this supervisor's) to the store, in batches."""
        if self.store is None:
            return
        own = [(t, "supervisor", line) for t, _stream, line in self._output.drain()]
        with self._lock:
            lines, self._logs = self._logs + own, []
        if lines:
            lines.sort(key=lambda x: x[0])
            try:
                self.store.add_logs(self.job_id, lines)
            except Exception as e:  # noqa: BLE001 - output lines are not worth failing a job over
                log.warning("could not store %d log line(s): %s", len(lines), e)

    def _flush_metrics(self) -> None:
        """Rows in step order, each step once (a step re-run after a recovery is not written again)."""
        with self._lock:
            rows = []
            for step in sorted(self._pending_rows):
                if step <= self._last_row_step:
                    continue
                rows.append(self._pending_rows[step])
                self._last_row_step = step
            self._pending_rows.clear()
        if not rows:
            return
        for r in rows:
            self._metrics_log.write(r)
            if self._tb is not None:
                self._tb.log_line(r)
        self._last_row = rows[-1]
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.add_metrics(self.job_id, rows)
        self._note_step(rows[-1])

    def _note_step(self, row: dict[str, Any]) -> None:
        rec = self._recovery
        if rec is not None and row.get("generation") == self.generation:
            self._finish_recovery_timing(rec, row)

    # ================================================================= the main thread
    def _main(self) -> None:
        from workers.metrics_log import MetricsLog

        try:
            from service.job_paths import FolderTaken, claim_folder

            try:
                claim_folder(self.output_dir, self.job_id)
            except FolderTaken as e:
                raise JobFailed(str(e)) from None
            metrics_path = self.output_dir / "metrics.jsonl"
            if self.restarted and metrics_path.exists():  # go on after the rows already written
                from workers.metrics_log import read_metrics

                self._last_row_step = max([int(r["step"]) for r in read_metrics(metrics_path)] + [0])
            self._metrics_log = MetricsLog(metrics_path, truncate=not self.restarted)
            if self.spec.tensorboard:
                from workers.tensorboard import TensorBoardLog

                self._tb = TensorBoardLog(self.output_dir / "tensorboard")
            if self.restarted:
                self._event("supervisor_restarted", "the supervisor restarted; finding the job's workers")
                self._adopt()
            else:
                self._event("started", f"The supervisor of job {self.job_id} started; the job's folder is "
                            f"{self.output_dir}.", dp_min=self.dp_min, dp_max=self.dp_max, model_parallel=self.mp,
                            output_dir=str(self.output_dir), checkpoint_uri=self.spec.checkpoint.uri)
                self._start()
            self._loop()
        except JobFailed as e:
            self._fail(str(e))
        except _Cancelled:
            self._stop_all()
            self._to(JobState.CANCELLED, "cancelled")
            self._event("cancelled", "job cancelled")
        except Exception as e:  # noqa: BLE001 - the job fails with the reason; the actor stays to say so
            self._fail(f"supervisor error: {type(e).__name__}: {e}", tb=traceback.format_exc())
        finally:
            with contextlib.suppress(Exception):
                self._flush_metrics()
            self._release_all()
            self._flush_logs()
            with contextlib.suppress(Exception):
                self._metrics_log.close()
            if self._tb is not None:
                with contextlib.suppress(Exception):
                    self._tb.close()
            self._done.set()
            self._exit()

    def _exit(self) -> None:
        if self.store is None:
            self._shutdown.wait(_LINGER_S)
        else:
            self._shutdown.wait(1.0)
        with contextlib.suppress(Exception):
            ray.kill(self._self, no_restart=True)

    def _fail(self, reason: str, tb: str | None = None) -> None:
        self.reason = reason
        if self.sm.can(JobState.FAILED):
            self._to(JobState.FAILED, reason)
        self._event("failed", reason, **({"traceback": tb} if tb else {}))

    # ----------------------------------------------------------------- capacity
    def _fill_dp(self) -> int:
        total = ray.cluster_resources()
        per = self.per_worker or {"CPU": 1.0}
        fits = min(int(total.get(k, 0.0) // (v * self.mp)) for k, v in per.items() if v)
        return max(1, fits)

    def _request_replica(self) -> Replica:
        idx = self._next_replica
        self._next_replica += 1
        rep = Replica(idx, reserve_replica(self.job_id, idx, self.mp, self.per_worker))
        self.replicas[idx] = rep
        return rep

    def _spawn(self, rep: Replica) -> None:
        from service.store import spec_to_private_json
        from workers.worker import Worker

        assert rep.res is not None
        engine = self.spec_engine_json()
        ckpt = spec_to_private_json(self.spec.checkpoint)  # workers need the real S3 keys, not the mask
        env = dict(self.spec.runtime_env.env_vars)
        env.update({k: v.get_secret_value() for k, v in self.spec.runtime_env.secret_env_vars.items()})
        env.setdefault("OMP_NUM_THREADS", "1")
        for local in range(self.mp):
            n = self._next_worker
            self._next_worker += 1
            name = worker_name(self.job_id, n)
            opts = {
                "job_id": self.job_id, "output_dir": str(self.output_dir),
                "heartbeat_interval_s": self.ft.heartbeat_interval_s,
                "collective_timeout_s": self.ft.collective_timeout_s,
                "chaos": [c.model_dump() for c in self.spec.chaos],
                "replica": rep.index, "local": local,
            }
            cls = ray.remote(Worker)
            handle = cls.options(
                name=name, namespace=self.namespace, lifetime="detached", max_concurrency=8, max_restarts=0,
                num_cpus=self.per_worker.get("CPU", 0.0), num_gpus=self.per_worker.get("GPU", 0.0),
                resources={k: v for k, v in self.per_worker.items() if k not in ("CPU", "GPU")} or None,
                scheduling_strategy=rep.res.strategy(local), runtime_env={"env_vars": env},
            ).remote(name, engine, ckpt, opts, self._self)
            slot = Slot(name, handle, rep.index, local)
            slot.info_ref = handle.info.remote()
            rep.slots.append(slot)
        rep.state = "starting"
        rep.since = time.monotonic()

    def spec_engine_json(self) -> str:
        from parallel.config import EngineConfig

        fields = set(EngineConfig.model_fields)
        data = {k: v for k, v in self.spec.model_dump(mode="json").items() if k in fields}
        data["training"]["output_dir"] = str(self.output_dir)
        return EngineConfig.model_validate(data).model_dump_json()

    def _advance(self) -> None:
        """Move replicas along without blocking: granted bundles get workers, started workers get ready."""
        for rep in list(self.replicas.values()):
            if rep.state == "pending" and rep.res is not None and rep.res.ready(0):
                self._spawn(rep)
            elif rep.state == "starting":
                refs = [s.info_ref for s in rep.slots]
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                if len(done) < len(refs):
                    continue
                try:
                    for s in rep.slots:
                        s.info = ray.get(s.info_ref)
                    rep.state = "ready"
                    where = sorted({str(s.info.get("node_name")) for s in rep.slots if s.info})
                    self._event("replica_ready", f"Replica {rep.index} is ready: {_plural(self.mp, 'worker')} on "
                                f"node {', '.join(where)}.", replica=rep.index, nodes=where)
                except RayActorError as e:
                    self._event("replica_failed", f"Replica {rep.index} failed to start: {_first_line(e)}",
                                replica=rep.index)
                    self._drop_replica(rep)

    def _count(self, *states: str) -> int:
        return sum(1 for r in self.replicas.values() if r.state in states)

    def _top_up(self) -> None:
        """Ask for replacements so active + spares + on the way reach dp_max (they start when capacity allows)."""
        while self._count("active", "ready", "starting", "pending") < self.dp_max:
            self._request_replica()

    def _drop_replica(self, rep: Replica, why: str = "dropped") -> None:
        for s in rep.slots:
            if s.dead is None:
                s.dead = why
            with contextlib.suppress(Exception):
                ray.kill(s.handle, no_restart=True)
        if rep.res is not None:
            release(rep.res)
        rep.state = "dead"

    # ----------------------------------------------------------------- start and adopt
    def _start(self) -> None:
        for _ in range(self.dp_max):
            self._request_replica()
        deadline = time.monotonic() + self.ft.wait_for_capacity_s
        grace_until: float | None = None
        while True:
            if self._cancel.is_set():
                raise _Cancelled()
            self._advance()
            ready = self._count("ready")
            if ready >= self.dp_max:
                break
            if ready >= self.dp_min and self._count("starting") == 0:
                grace_until = grace_until or time.monotonic() + _START_GRACE_S
                if time.monotonic() >= grace_until:
                    break
            if time.monotonic() > deadline and self._count("starting") == 0:
                raise JobFailed(
                    f"only {ready} of the dp.min={self.dp_min} replica(s) ({self.mp} worker(s) each, "
                    f"{self.per_worker} per worker) could start within wait_for_capacity_s="
                    f"{self.ft.wait_for_capacity_s:g}; add capacity or lower resources.dp.min"
                )
            time.sleep(_POLL_S)
        reps = sorted((r for r in self.replicas.values() if r.state == "ready"), key=lambda r: r.index)
        self._probe(reps[0].slots[0])
        ck = self.spec.checkpoint
        self._launch(0, reps[: self.dp_max], restore=ck.resume or bool(ck.resume_from))
        self._to(JobState.RUNNING, "workers started")

    def _probe(self, slot: Slot) -> None:
        """The start-up checks (workers.probe) on a worker's node before the gang starts: a problem there
        is deterministic, so the job fails now with it rather than going through recoveries."""
        try:
            problems = ray.get(slot.handle.probe.remote(), timeout=300)
        except RayActorError as e:
            raise JobFailed(f"the start-up check could not run: {_first_line(e)}") from None
        if problems:
            raise JobFailed("the job cannot start: " + "; ".join(problems))
        self._event("checked", "Start-up checks passed on node "
                    f"{(slot.info or {}).get('node_name', '?')}: data, checkpoint storage and inputs are reachable.")

    def _adopt(self) -> None:
        """After our own restart: find the workers by name, stop them, and re-form from the last state."""
        prefix = f"job-{self.job_id}/worker-"
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == self.namespace and str(a.get("name", "")).startswith(prefix)]
        slots: list[Slot] = []
        for name in names:
            with contextlib.suppress(Exception):
                h = ray.get_actor(name, namespace=self.namespace)
                info = ray.get(h.info.remote(), timeout=10)
                slots.append(Slot(name, h, int(info.get("replica", -1)), int(info.get("local", 0)), info=info))
                self._next_worker = max(self._next_worker, int(name.rsplit("-", 1)[1]) + 1)
        last_gen = max([int(s.info["generation"]) for s in slots if s.info] + [0])
        for s in slots:
            s.handle.abort.remote(last_gen)  # stop the generation the crashed instance ran
        deadline = time.monotonic() + self.ft.collective_timeout_s + 10
        while time.monotonic() < deadline:
            phases = []
            for s in slots:
                try:
                    s.info = ray.get(s.handle.info.remote(), timeout=5)
                    phases.append(s.info["phase"])
                except Exception:  # noqa: BLE001
                    s.dead = "gone"
            if all(p in ("idle", "finished") for p in phases):
                break
            time.sleep(0.2)
        by_rep: dict[int, list[Slot]] = {}
        for s in slots:
            if s.dead is None and s.info is not None and s.info["phase"] in ("idle", "finished"):
                by_rep.setdefault(s.replica, []).append(s)
            else:
                with contextlib.suppress(Exception):
                    ray.kill(s.handle, no_restart=True)
        from ray.util import get_placement_group

        from service.placement import ReplicaReservation, job_placement_groups, replica_pg_name

        for idx, group in sorted(by_rep.items()):
            res = None
            with contextlib.suppress(Exception):  # the replica's detached group, found by name
                pg = get_placement_group(replica_pg_name(self.job_id, idx))
                res = ReplicaReservation(idx, pg, pg.ready())
            rep = Replica(idx, res, sorted(group, key=lambda s: s.local), state="ready")
            if len(group) != self.mp:
                self._drop_replica(rep, "incomplete replica after a supervisor restart")
                continue
            self.replicas[idx] = rep
            self._next_replica = max(self._next_replica, idx + 1)
        kept = {replica_pg_name(self.job_id, i) for i in self.replicas}
        for info in job_placement_groups(self.job_id):  # reservations without live workers
            if info.get("name") not in kept:
                with contextlib.suppress(Exception):
                    release(get_placement_group(info["name"]))
        self._event("adopted", f"found {sum(len(r.slots) for r in self.replicas.values())} live worker(s) "
                    f"of generation {last_gen}", generation=last_gen)
        self.generation = last_gen
        dp = self.scaling.choose(self._count("ready"))
        if dp is None:
            dp = self._wait_for_capacity()
        reps = sorted((r for r in self.replicas.values() if r.state == "ready"), key=lambda r: r.index)[:dp]
        self._top_up()
        self._launch(last_gen + 1, reps, restore=True)
        self._to(JobState.RUNNING, "re-formed after a supervisor restart")

    # ----------------------------------------------------------------- generations
    def _timeout_s(self) -> float:
        from workers.group import collective_timeout_s

        step_times = [float(m.get("step_time_s", 0)) for _, m in self._hb.values() if "step_time_s" in m]
        return collective_timeout_s(self.ft.collective_timeout_s, max(step_times) if step_times else None)

    def _ensure_keepers(self, slots: list[Slot]) -> None:
        """A keeper on every node the job uses (kept for nodes it used before, while they live).

        Nodes are named from Ray itself (checkpointing.keeper.node_name_of), so this works on any
        cluster. One node means one copy of each shard: said once, as a warning event."""
        if not self.spec.checkpoint.in_memory_every:
            return
        from checkpointing.keeper import ensure_keepers, node_ids_by_name

        alive = node_ids_by_name()
        nodes = {str(s.info["node_name"]) for s in slots if s.info and s.info.get("node_name")}
        for name in list(self.keepers):
            if name not in nodes and name not in alive:
                self.keepers.pop(name)  # its node is gone, and its memory with it
        missing = sorted(nodes - set(self.keepers))
        if missing:
            try:
                self.keepers.update(ensure_keepers(missing, memory_limit_mb=self.spec.checkpoint.keeper_memory_limit_mb))
            except (TimeoutError, ValueError) as e:
                self._event("keepers_missing", f"in-memory snapshots: no keeper on node(s) {', '.join(missing)} "
                            f"({e}); their ranks' snapshots go to the other nodes' keepers", nodes=missing)
        if not self.keepers:
            raise JobFailed("checkpoint.in_memory_every is set but no node could hold an in-memory snapshot "
                            "(no keeper could be started); set checkpoint.in_memory_every: 0 or check the cluster")
        if len(self.keepers) < 2 and "one_copy" not in self.warnings:
            self.warnings.append("one_copy")
            only = next(iter(self.keepers))
            self._event("warning", f"In-memory snapshots are kept on one node only ({only}): a worker failure "
                        "recovers from memory, but the loss of that node falls back to the last persistent "
                        "checkpoint. Add a second node to keep a second copy.", node=only, copies=1)

    def _commit_snapshots(self) -> None:
        """Commit the newest snapshot every rank has acknowledged (the keepers check the copies).

        Only up to the last step whose metrics row is written: a restore never skips a step whose row
        was lost (e.g. held in memory when this supervisor crashed), since it goes back and re-runs it.
        """
        self._flush_metrics()
        with self._lock:
            ready = sorted((k for k, v in self._acks.items()
                            if len(v["ranks"]) >= v["world"] and k[1] <= self._last_row_step), reverse=True)
        if not ready or not self.keepers:
            return
        from checkpointing.keeper import commit_snapshot

        for key in ready:
            try:
                ok = commit_snapshot(self.keepers, self.job_id, key[0], key[1], self._acks[key]["world"])
            except Exception as e:  # noqa: BLE001 - an uncommitted snapshot only costs steps
                log.warning("commit of snapshot %s failed: %s", key, e)
                ok = False
            if ok:
                with self._lock:
                    self.committed = key
                    for k in [k for k in self._acks if k <= key]:
                        self._acks.pop(k)
                return

    def _restore_target(self) -> dict[str, Any]:
        self._commit_snapshots()
        if self.committed is None and self.keepers:  # e.g. after our own restart: ask the keepers
            from checkpointing.keeper import committed_snapshots

            with contextlib.suppress(Exception):
                ids = committed_snapshots(self.keepers, self.job_id)
                if ids:
                    self.committed = (int(ids[-1][0]), int(ids[-1][1]))
        if self.committed is None:
            return {"step": None, "generation": None}
        return {"generation": self.committed[0], "step": self.committed[1]}

    def _launch(self, generation: int, reps: list[Replica], *, restore: bool) -> None:
        dp = len(reps)
        world = dp * self.mp
        slots: list[Slot] = []
        for d, rep in enumerate(reps):
            rep.state = "active"
            for s in rep.slots:
                s.rank = rank_of(d, s.local, dp, self.cp_tp)
                s.result = None
                s.run_ref = None
                slots.append(s)
        with self._lock:
            self.generation = generation
            self.dp = dp
            self._formed.clear()
            self._step_reports.clear()
        self.stragglers.reset()
        self._ensure_keepers(slots)
        target = self._restore_target() if restore else None
        if generation == 0 and restore and target == {"step": None, "generation": None}:
            target = {"step": None, "generation": None, "resume": True}  # a persistent checkpoint, if any
        timeout = self._timeout_s()
        rank0 = next(s for s in slots if s.rank == 0)
        assert rank0.info is not None
        port = ray.get(rank0.handle.open_store.remote(generation, world, timeout), timeout=60)
        host = rank0.info["host"]
        self._gen_started = time.monotonic()
        for s in slots:
            s.run_ref = s.handle.run.remote(generation, s.rank, world, host, port, dp, restore=target,
                                            timeout_s=timeout, keepers=self.keepers or None)
        telemetry.record_group(self.job_id, dp, generation)
        self._event("generation", f"Generation {generation} starts with {_plural(world, 'worker')} at dp={dp}"
                    + _restore_phrase(target) + ".",
                    generation=generation, dp=dp, world_size=world, restore=target,
                    ranks={s.name: s.rank for s in slots}, keepers=sorted(self.keepers))

    def _active_slots(self) -> list[Slot]:
        return [s for r in self.replicas.values() if r.state == "active" for s in r.slots]

    # ----------------------------------------------------------------- the watch loop
    def _loop(self) -> None:
        while True:
            outcome = self._watch()
            if outcome == "finished":
                self._to(JobState.FINISHING, "every rank finished")
                self._flush_metrics()
                self._to(JobState.SUCCEEDED, "finished")
                self._event("finished", f"job finished: {self._last_row_step} steps, "
                            f"{self.recoveries} recovery(ies)", steps=self._last_row_step,
                            recoveries=self.recoveries)
                return
            if outcome == "cancelled":
                self._stop_all()
                self._to(JobState.CANCELLED, "cancelled")
                self._event("cancelled", "job cancelled")
                return
            if outcome == "grow":
                self._grow()
                continue
            assert isinstance(outcome, Failure)
            self._recover(outcome)

    def _watch(self) -> str | Failure:
        """Until the generation ends: finished, paused for growth, cancelled, or a failure."""
        hb_timeout = self.ft.heartbeat_timeout_s
        while True:
            if self._cancel.is_set():
                return "cancelled"
            self._commit_snapshots()  # flushes the metrics rows first
            if time.monotonic() - self._logs_flushed_at > _LOG_FLUSH_S:
                self._logs_flushed_at = time.monotonic()
                self._flush_logs()
            self._advance()
            slots = self._active_slots()
            pending = [s for s in slots if s.result is None]
            if pending:
                done, _ = ray.wait([s.run_ref for s in pending], num_returns=len(pending), timeout=_POLL_S)
                done_set = set(done)
                found = [f for s in pending if s.run_ref in done_set and (f := self._collect(s)) is not None]
                if found:
                    # Peers of the failed rank fail too (their collectives break): name the cause, not them.
                    return min(found, key=lambda f: f.kind == "collective_error")
            if all(s.result is not None for s in slots):
                statuses = {s.result["status"] for s in slots if s.result}
                if statuses == {"finished"}:
                    return "finished"
                if statuses == {"paused"}:
                    return "grow"
                return Failure("collective_error", [], f"generation ended with {statuses}", time.time())
            now = time.time()
            with self._lock:
                hbs = dict(self._hb)
            for s in slots:
                if s.result is not None:
                    continue
                seen = hbs.get(s.name, (None, None))[0]
                if seen is not None and now - seen > hb_timeout:
                    fault = self._fault_of(s)
                    cause = f" (hung by chaos: {fault['kind']})" if fault else ""
                    return Failure("hang", [s], f"Rank {s.rank} ({s.name.rsplit('/', 1)[-1]}) sent no heartbeat "
                                   f"for {now - seen:.1f}s{cause}; heartbeat_timeout_s={hb_timeout:g}.", now,
                                   t_fault=seen)
            self._export_heartbeat_ages(slots, hbs, now)
            f = self._check_stragglers(slots)
            if f is not None:
                return f
            self._maybe_grow(slots)

    def _export_heartbeat_ages(self, slots: list[Slot], hbs: dict[str, tuple[float, dict[str, Any]]],
                               now: float) -> None:  # fmt: skip
        if now - self._heartbeats_exported_at < _HEARTBEAT_GAUGE_S:
            return
        self._heartbeats_exported_at = now
        for s in slots:
            seen = hbs.get(s.name, (None, None))[0]
            if seen is not None and s.rank >= 0:
                telemetry.record_heartbeat_age(self.job_id, s.rank, max(0.0, now - seen))

    def _collect(self, s: Slot) -> Failure | None:
        """Read a finished run call; a failure when it did not end well."""
        try:
            s.result = ray.get(s.run_ref)
        except ActorUnavailableError:
            return None  # suspect, not dead: heartbeats decide
        except (ActorDiedError, RayActorError) as e:
            s.result = {"status": "dead", "error": str(e)}
            s.dead = "died"
            kind = "node_died" if self._node_dead(s) else "worker_died"
            return Failure(kind, [s], self._death_text(s, kind, e), time.time(), t_fault=self._fault_time(s))
        res = s.result
        if res["status"] in ("finished", "paused"):
            return None
        if res["status"] == "error":
            formed = s.name in self._formed
            kind = "collective_error" if res.get("collective") else ("step_error" if formed else "build_error")
            return Failure(kind, [s] if kind != "collective_error" else [],
                           f"{s.name} (rank {s.rank}): {_first_line(res.get('error', ''))}",
                           time.time(), t_fault=res.get("time"), step=res.get("step"))
        return Failure("collective_error", [], f"{s.name} (rank {s.rank}) stopped: {res['status']}", time.time())

    def _node_dead(self, s: Slot) -> bool:
        node = (s.info or {}).get("node_id")
        if node is None:
            return False
        for n in ray.nodes():
            if n["NodeID"] == node:
                return not n.get("Alive", False)
        return True

    def _fault_time(self, s: Slot) -> float | None:
        f = self._fault_of(s)
        return float(f["time"]) if f else None

    def _fault_of(self, s: Slot) -> dict[str, Any] | None:
        """The chaos fault that fired in this worker's current generation, if any."""
        with self._lock:
            for f in reversed(self._faults):
                if f.get("worker") == s.name and f.get("generation") == self.generation:
                    return f
        return None

    def _death_text(self, s: Slot, kind: str, e: BaseException) -> str:
        """One sentence, the cause first: chaos by name; a node loss; else Ray's first line."""
        who = f"Rank {s.rank} ({s.name.rsplit('/', 1)[-1]} on node {(s.info or {}).get('node_name', '?')})"
        fault = self._fault_of(s)
        if fault is not None:
            return f"{who} was stopped by chaos ({fault['kind']} before step {int(fault['step']) + 1})."
        if kind == "node_died":
            return f"{who} was lost with its node."
        return f"{who} died: {_first_line(e)}"

    def _check_stragglers(self, slots: list[Slot]) -> Failure | None:
        names = {s.name for s in slots}
        with self._lock:
            complete = sorted(st for st, rep in self._step_reports.items() if set(rep["gap"]) >= names)
            reports = [self._step_reports.pop(st) for st in complete]
        for rep in reports:
            for name in self.stragglers.observe(rep["gap"], rep["time"]):
                s = next(x for x in slots if x.name == name)
                msg = (f"{name} (rank {s.rank}) is a straggler: its own time per step is over "
                       f"{self.ft.straggler_factor:g}x the median")
                if self.ft.straggler_action == "replace":
                    return Failure("straggler", [s], msg, time.time())
                self._event("straggler", msg, worker=name, rank=s.rank, action="warn")
        return None

    def _maybe_grow(self, slots: list[Slot]) -> None:
        if self._pausing is not None or self.dp >= self.dp_max or self._count("ready") == 0:
            return
        if self._recovery is not None:
            return  # the recovering generation first completes a step (and says `recovered`)
        if self._count("starting"):
            return  # more replicas are on their way: grow once, with all of them
        if self.scaling.wants_growth(self.dp, self._count("ready")) == 0:
            return
        every = self.spec.checkpoint.in_memory_every or self.spec.checkpoint.persist_every or 1
        with self._lock:
            seen = max([int(m.get("step", 0)) for _, m in self._hb.values()
                        if m.get("generation") == self.generation] + [0])
        target = ((seen + 2 + every - 1) // every) * every
        if target >= self.spec.training.steps:
            return
        self._pausing = target
        for s in slots:
            s.handle.pause_at.remote(self.generation, target)
        self._event("growing", f"{self._count('ready')} spare replica(s) ready: pausing after step {target} to grow",
                    step=target)

    # ----------------------------------------------------------------- recovery and growth
    def _stop_generation(self, slots: list[Slot], culprits: list[Slot]) -> None:
        """Every run call of the ending generation returns, or its worker is written off."""
        for s in culprits:
            if s.dead is None:
                s.dead = "failed"
            with contextlib.suppress(Exception):
                ray.kill(s.handle, no_restart=True)  # a hung worker's sockets close: its peers fail fast
            _sigkill_if_local(s)
        for s in slots:
            if s.dead is None:
                with contextlib.suppress(Exception):
                    s.handle.abort.remote(self.generation)
        deadline = time.monotonic() + self._timeout_s() + 10.0
        while time.monotonic() < deadline:
            pending = [s for s in slots if s.result is None and s.dead is None]
            if not pending:
                break
            done, _ = ray.wait([s.run_ref for s in pending], num_returns=len(pending), timeout=0.2)
            for s in pending:
                if s.run_ref in done:
                    try:
                        s.result = ray.get(s.run_ref)
                    except ActorUnavailableError:
                        s.suspect_since = s.suspect_since or time.monotonic()
                    except (ActorDiedError, RayActorError) as e:
                        s.result = {"status": "dead", "error": str(e)}
                        s.dead = "died"
        for s in slots:
            if s.result is None and s.dead is None:
                s.dead = "could not leave its group in time"
                with contextlib.suppress(Exception):
                    ray.kill(s.handle, no_restart=True)

    def _recover(self, failure: Failure) -> None:
        t_detect = failure.t_detect
        self._close_recovery()  # an earlier recovery still replaying: it ends here, with what it reached
        old_dp, old_gen = self.dp, self.generation
        last_step = self._last_step_seen
        ok, why = self.failures.decide(failure.kind, self.recoveries, failure.step)
        self._event("failure_detected", failure.detail, kind=failure.kind, generation=old_gen,
                    workers=[s.name for s in failure.slots], ranks=[s.rank for s in failure.slots],
                    step=last_step, recover=ok,
                    detect_s=(t_detect - failure.t_fault) if failure.t_fault else None)
        if not ok:  # deterministic (a start-up error, the same step failing again): fail now, no recovery
            self._stop_generation(self._active_slots(), failure.slots)
            raise JobFailed(f"{failure.detail.rstrip('.')}; not recovering: {why}")
        self._to(JobState.RECOVERING, failure.detail)
        self.recoveries += 1
        telemetry.record_recovery(self.job_id, failure.kind)
        self._pausing = None
        active = [r for r in self.replicas.values() if r.state == "active"]
        slots = [s for r in active for s in r.slots]
        self._stop_generation(slots, failure.slots)
        for s in slots:  # a rank whose own step raised (not a broken collective) is replaced
            res = s.result or {}
            if s.dead is None and res.get("status") == "error" and not res.get("collective"):
                s.dead = "its step raised"
                with contextlib.suppress(Exception):
                    ray.kill(s.handle, no_restart=True)
        for rep in active:
            if any(s.dead is not None for s in rep.slots):
                self._drop_replica(rep, "lost a member")
            else:
                rep.state = "ready"
        self._top_up()
        live = self._count("ready")
        dp = self.scaling.choose(live)
        if dp is None:
            dp = self._wait_for_capacity()
        if dp < old_dp:
            self._check_resize_fits(dp)
        reps = sorted((r for r in self.replicas.values() if r.state == "ready"), key=lambda r: r.index)[:dp]
        t_launch = time.time()
        self._launch(old_gen + 1, reps, restore=True)
        if dp != old_dp:
            self._event("resized", f"dp {old_dp} -> {dp} (world {old_dp * self.mp} -> {dp * self.mp})",
                        old_dp=old_dp, new_dp=dp, generation=self.generation, cause=failure.kind)
        self._recovery = {
            "kind": failure.kind, "cause": _cause_phrase(failure), "t_fault": failure.t_fault, "t_detect": t_detect, "t_launch": t_launch,
            "last_step": last_step, "generation": self.generation,
        }
        self._to(JobState.RUNNING, f"re-formed at dp={dp}")

    def _check_resize_fits(self, dp: int) -> None:
        """The planner's memory check at the smaller dp (a bigger share of the fixed global batch and
        of the model states per rank): fail with the reason rather than run out of memory."""
        from service.autolayout import check_resize, cluster_for_job

        try:
            cluster = cluster_for_job(self.spec, ray.cluster_resources()).cluster
            reasons = check_resize(self.spec, dp, cluster)
        except Exception as e:  # a job or cluster the planner cannot model: say so and go on
            self._event("resize_check", f"memory not re-checked at dp={dp}: {e}", dp=dp, fits=None)
            return
        if reasons:
            raise JobFailed(f"shrinking to dp={dp} would not fit in memory: {'; '.join(reasons[:3])}")
        self._event("resize_check", f"dp={dp} still fits in memory (planner)", dp=dp, fits=True)

    def _wait_for_capacity(self) -> int:
        """Below dp.min: wait for replacements up to wait_for_capacity_s, then fail."""
        wait = self.ft.wait_for_capacity_s
        self._event("waiting_for_capacity",
                    f"{self._count('ready')} replica(s) alive, below dp.min={self.dp_min}; waiting up to {wait:g}s",
                    alive=self._count("ready"), dp_min=self.dp_min)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self._cancel.is_set():
                raise _Cancelled()
            self._top_up()
            self._advance()
            dp = self.scaling.choose(self._count("ready"))
            if dp is not None:
                return dp
            time.sleep(0.2)
        raise JobFailed(
            f"below dp.min={self.dp_min}: only {self._count('ready')} replica(s) of {self.mp} worker(s) "
            f"alive after waiting wait_for_capacity_s={wait:g}; add capacity or lower resources.dp.min"
        )

    def _finish_recovery_timing(self, rec: dict[str, Any], row: dict[str, Any] | None) -> None:
        """The one `recovered` event of a recovery, once its generation completed a step (`row`): the
        cause first, then the phases in order. With row=None the recovery was cut short (a new failure
        before its first step) and says so instead."""
        now = time.time()
        self._recovery = None
        if row is None:
            self._event("recovery_interrupted", f"The recovery into generation {rec['generation']} was "
                        "interrupted by a new failure before its first step.", generation=rec["generation"])
            return
        with self._lock:
            formed = dict(self._formed)
        t_formed = max((float(m["time"]) for m in formed.values()), default=now)
        restore_s = max((float(m.get("timings", {}).get("restore_s", 0.0)) for m in formed.values()), default=0.0)
        restored = min((int(m.get("restored", {}).get("step", 0)) for m in formed.values()), default=0)
        sources = sorted({str(m.get("restored", {}).get("source")) for m in formed.values()})
        fallback = sorted({str(m["restored"]["fallback_reason"]) for m in formed.values()
                           if m.get("restored", {}).get("fallback_reason")})
        detect_s = rec["t_detect"] - rec["t_fault"] if rec["t_fault"] else None
        reform_s = max(0.0, t_formed - rec["t_detect"] - restore_s)
        replay_s = max(0.0, now - t_formed)
        total = now - (rec["t_fault"] or rec["t_detect"])
        lost = max(0, rec["last_step"] - restored)
        if self._tb is not None:
            with contextlib.suppress(Exception):
                self._tb.log_recovery(int(row["step"]), int(rec["generation"]), str(rec["kind"]),
                                      f"restored step {restored} from {'/'.join(sources)}")
        where = " and ".join(_SOURCE_WORDS.get(x, x) for x in sources)
        self._event(
            "recovered",
            f"Recovered from {rec['cause']} in {total:.2f}s: detect {_fmt_s(detect_s)}, re-form {reform_s:.2f}s, "
            f"restore {restore_s:.2f}s (step {restored} {where}), replay {replay_s:.2f}s; "
            f"{_plural(lost, 'step')} lost; generation {rec['generation']} completed step {row['step']}."
            + (f" The in-memory snapshot could not be used: {fallback[0]}." if fallback else ""),
            generation=rec["generation"], kind=rec["kind"], restored_step=restored, source=sources,
            last_step=rec["last_step"], lost_steps=lost,
            detect_s=detect_s, reform_s=reform_s, restore_s=restore_s, replay_s=replay_s, total_s=total,
            first_step=row["step"], fallback_reason=fallback[0] if fallback else None,
        )

    def _close_recovery(self) -> None:
        if self._recovery is not None:
            self._finish_recovery_timing(self._recovery, None)

    def _grow(self) -> None:
        self._to(JobState.RESIZING, "growing")
        old_dp = self.dp
        self._pausing = None
        active = sorted((r for r in self.replicas.values() if r.state == "active"), key=lambda r: r.index)
        spares = sorted((r for r in self.replicas.values() if r.state == "ready"), key=lambda r: r.index)
        add = self.scaling.wants_growth(old_dp, len(spares))
        reps = active + spares[:add]
        self._launch(self.generation + 1, reps, restore=True)
        self._event("resized", f"dp {old_dp} -> {len(reps)} (world {old_dp * self.mp} -> {len(reps) * self.mp})",
                    old_dp=old_dp, new_dp=len(reps), generation=self.generation, cause="growth")
        self._to(JobState.RUNNING, f"grown to dp={len(reps)}")

    # ----------------------------------------------------------------- the end
    def _stop_all(self) -> None:
        slots = self._active_slots()
        for s in slots:
            with contextlib.suppress(Exception):
                s.handle.abort.remote(10**9)
        deadline = time.monotonic() + 5.0
        refs = [s.run_ref for s in slots if s.run_ref is not None and s.result is None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))

    def _release_all(self) -> None:
        """Workers, placement groups, scratch snapshots and keeper memory of the job: all go."""
        for rep in self.replicas.values():
            for s in rep.slots:
                with contextlib.suppress(Exception):
                    ray.kill(s.handle, no_restart=True)
            if rep.res is not None:
                release(rep.res)
        # Workers this instance may not know (started by an instance that crashed).
        prefix = f"job-{self.job_id}/worker-"
        with contextlib.suppress(Exception):
            for a in ray.util.list_named_actors(all_namespaces=True):
                if a.get("namespace") == self.namespace and str(a.get("name", "")).startswith(prefix):
                    with contextlib.suppress(Exception):
                        ray.kill(ray.get_actor(a["name"], namespace=self.namespace), no_restart=True)
        with contextlib.suppress(Exception):
            release_job_groups(self.job_id)
        freed = 0
        if self.keepers:
            with contextlib.suppress(Exception):
                from checkpointing.keeper import drop_job

                freed = drop_job(self.keepers, self.job_id)
        self._event("released", f"workers, placement groups and {freed} bytes of keeper memory released",
                    keeper_bytes=freed)


class _Cancelled(Exception):
    pass


def _sigkill_if_local(s: Slot) -> None:
    """A SIGSTOPped worker answers no RPC, so Ray's kill may take long: SIGKILL it by PID when it is
    on this host (same hostname and Ray node IP), at once."""
    info = s.info or {}
    if not info.get("pid") or info.get("hostname") != socket.gethostname():
        return
    if info.get("node_ip") not in (None, ray.util.get_node_ip_address()):
        return
    with contextlib.suppress(OSError):
        os.kill(int(info["pid"]), signal.SIGKILL)


def _first_line(e: Any) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


_SOURCE_WORDS = {"keepers": "from memory", "memory": "from memory", "persistent": "from the persistent checkpoint",
                 "fresh": "from scratch", "resume_from": "from checkpoint.resume_from"}


def _cause_phrase(f: Failure) -> str:
    """The failure in a few words, for the `recovered` sentence."""
    ranks = sorted({s.rank for s in f.slots if s.rank >= 0})
    who = f"rank {', '.join(map(str, ranks))}" if ranks else "a broken collective"
    return {
        "worker_died": f"the loss of {who}", "node_died": f"the loss of a node ({who})",
        "hang": f"a hang of {who}", "step_error": f"an error in the step of {who}",
        "straggler": f"replacing the straggler {who}", "collective_error": "a broken collective",
    }.get(f.kind, f"{f.kind} ({who})")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _restore_phrase(target: dict[str, Any] | None) -> str:
    """How a generation starts, in words (the restore target the workers get)."""
    if target is None:
        return ", from scratch"
    if target.get("step") is not None:
        return f", restoring the in-memory snapshot of step {target['step']}"
    if target.get("resume"):
        return ", from the job's newest persistent checkpoint if it has one"
    return ", from the newest persistent checkpoint (no in-memory snapshot is committed)"


def _fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}s"


# ===================================================================== the agreed entry points
def launch_supervisor(job_id: str, spec: Any, *, store_url: str | None, namespace: str = NAMESPACE) -> Any:
    """Create the detached named actor `job-<id>/supervisor`, which runs the job; returns its handle."""
    from service.store import spec_to_private_json

    resources: dict[str, float] = {}
    with contextlib.suppress(Exception):
        from checkpointing.keeper import CONTROL_RESOURCE

        # Supervisors go to nodes meant for the control path where the cluster has some (the KubeRay
        # manifests' cpu group, our local clusters' head).
        if ray.cluster_resources().get(CONTROL_RESOURCE):
            resources[CONTROL_RESOURCE] = 0.001  # keep the supervisor off nodes that may be lost
    cls = ray.remote(Supervisor)
    return cls.options(
        name=supervisor_name(job_id), namespace=namespace, lifetime="detached",
        max_restarts=spec.fault_tolerance.supervisor_max_restarts, max_task_retries=0,
        max_concurrency=16, num_cpus=0, resources=resources or None,
    ).remote(job_id, spec_to_private_json(spec), store_url, namespace)


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
