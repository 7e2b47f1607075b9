"""One generation at a time: start it (ranks, keepers, restore target, the rank-0 store), watch it
until it ends, stop it.

`watch` returns how the generation ended: a `GenerationEnd` or the `Failure` that ended it.
"""

from __future__ import annotations

import contextlib
import time
from enum import Enum

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from service.policies import FailureKind, ScalingPolicy
from service.supervisor.committer import SnapshotCommitter
from service.supervisor.context import JobFailed, JobRun
from service.supervisor.detection import Failure, FailureDetector, root_cause
from service.supervisor.pool import Replica, ReplicaPool, ReplicaState, Slot
from service.supervisor.reporter import Reporter
from service.supervisor.words import first_line, plural, restore_phrase
from workers import telemetry
from workers.protocol import Heartbeat, RunResult, RunStatus

_POLL_S = 0.05
# How long a broken collective waits for the failure of a rank's own that broke it (see settle).
_ROOT_CAUSE_GRACE_S = 3.0


class GenerationEnd(Enum):
    FINISHED = "finished"    # every rank trained to the last step
    PAUSED = "paused"        # every rank paused at the agreed step: spares are ready to join
    CANCELLED = "cancelled"  # the user cancelled


def rank_of(replica_pos: int, local: int, dp: int, cp_tp: int) -> int:
    """The global rank of a replica's `local`-th worker, for the mesh order pp, dp, cp, tp.

    A replica is one model-parallel group (tp x pp x cp workers, placed together): its workers share
    the dp coordinate `replica_pos`; local // cp_tp is their pp stage, local % cp_tp their cp x tp place.
    """
    return (local // cp_tp) * (dp * cp_tp) + replica_pos * cp_tp + (local % cp_tp)


class Generations:
    def __init__(self, run: JobRun, reporter: Reporter, pool: ReplicaPool, committer: SnapshotCommitter,
                 detector: FailureDetector, scaling: ScalingPolicy) -> None:  # fmt: skip
        self.run = run
        self.reporter = reporter
        self.pool = pool
        self.committer = committer
        self.detector = detector
        self.scaling = scaling
        self.pausing: int | None = None  # the step the current generation pauses after, to grow

    def timeout_s(self) -> float:
        from workers.group import collective_timeout_s

        step_times = [m.last.step_time_s for _, m in self.run.hb.values() if isinstance(m, Heartbeat) and m.last]
        return collective_timeout_s(self.run.ft.collective_timeout_s, max(step_times) if step_times else None)

    def probe(self, slot: Slot) -> None:
        """The start-up checks (workers.probe) on a worker's node before the gang starts: a problem there
        is deterministic, so the job fails now with it rather than going through recoveries."""
        try:
            problems = ray.get(slot.handle.probe.remote(), timeout=300)
        except RayActorError as e:
            raise JobFailed(f"the start-up check could not run: {first_line(e)}") from None
        if problems:
            raise JobFailed("the job cannot start: " + "; ".join(problems))
        self.reporter.event("checked", "Start-up checks passed on node "
                            f"{(slot.info or {}).get('node_name', '?')}: data, checkpoint storage and inputs "
                            "are reachable.")

    # ----------------------------------------------------------------- start
    def launch(self, generation: int, reps: list[Replica], *, restore: bool) -> None:
        run = self.run
        dp = len(reps)
        world = dp * run.mp
        slots: list[Slot] = []
        for d, rep in enumerate(reps):
            rep.state = ReplicaState.ACTIVE
            for s in rep.slots:
                s.rank = rank_of(d, s.local, dp, run.cp_tp)
                s.result = None
                s.run_ref = None
                slots.append(s)
        with run.lock:
            run.generation = generation
            run.dp = dp
            run.formed.clear()
            run.step_reports.clear()
        self.detector.stragglers.reset()
        self.committer.ensure_keepers(slots)
        target = self.committer.restore_target() if restore else None
        if generation == 0 and restore and target == {"step": None, "generation": None}:
            target = {"step": None, "generation": None, "resume": True}  # a persistent checkpoint, if any
        if generation > 0:
            self.committer.fence(generation)  # after choosing the target: it may be of an older generation
        timeout = self.timeout_s()
        rank0 = next(s for s in slots if s.rank == 0)
        assert rank0.info is not None
        port = ray.get(rank0.handle.open_store.remote(generation, world, timeout), timeout=60)
        host = rank0.info["host"]
        keepers = self.committer.keepers
        for s in slots:
            s.run_ref = s.handle.run.remote(generation, s.rank, world, host, port, dp, restore=target,
                                            timeout_s=timeout, keepers=keepers or None)
        telemetry.record_group(run.job_id, dp, generation)
        self.reporter.event("generation", f"Generation {generation} starts with {plural(world, 'worker')} at "
                            f"dp={dp}" + restore_phrase(target) + ".",
                            generation=generation, dp=dp, world_size=world, restore=target,
                            ranks={s.name: s.rank for s in slots}, keepers=sorted(keepers))

    # ----------------------------------------------------------------- watch
    def watch(self) -> GenerationEnd | Failure:
        """Until the generation ends: finished, paused for growth, cancelled, or a failure."""
        run = self.run
        while True:
            if run.cancel.is_set():
                return GenerationEnd.CANCELLED
            self.committer.commit()  # flushes the metrics rows first
            self.reporter.maybe_flush_logs()
            self.pool.advance()
            slots = self.pool.active_slots()
            pending = [s for s in slots if s.result is None]
            if pending:
                done, _ = ray.wait([s.run_ref for s in pending], num_returns=len(pending), timeout=_POLL_S)
                done_set = set(done)
                found = [f for s in pending if s.run_ref in done_set and (f := self.detector.collect(s)) is not None]
                if found:
                    rest = [s for s in pending if s.run_ref not in done_set]
                    return root_cause(self.detector.settle(found, rest, _ROOT_CAUSE_GRACE_S))
            if all(s.result is not None for s in slots):
                statuses = {str(s.result.status) for s in slots if s.result}
                if statuses == {RunStatus.FINISHED}:
                    return GenerationEnd.FINISHED
                if statuses == {RunStatus.PAUSED}:
                    return GenerationEnd.PAUSED
                return Failure(FailureKind.COLLECTIVE_ERROR, [], f"generation ended with {statuses}", time.time())
            now = time.time()
            hbs = run.heartbeats()
            hung = self.detector.hung(slots, hbs, now)
            if hung is not None:
                return hung
            self.reporter.export_heartbeat_ages(slots, hbs, now)
            f = self.detector.check_stragglers(slots)
            if f is not None:
                return f
            self._maybe_pause_to_grow(slots)

    def _maybe_pause_to_grow(self, slots: list[Slot]) -> None:
        run, pool = self.run, self.pool
        if self.pausing is not None or run.dp >= run.dp_max or pool.count(ReplicaState.READY) == 0:
            return
        if self.reporter.recovery is not None:
            return  # the recovering generation first completes a step (and says `recovered`)
        if pool.count(ReplicaState.STARTING):
            return  # more replicas are on their way: grow once, with all of them
        if self.scaling.wants_growth(run.dp, pool.count(ReplicaState.READY)) == 0:
            return
        every = run.spec.checkpoint.in_memory_every or run.spec.checkpoint.persist_every or 1
        with run.lock:
            seen = max([int(getattr(m, "step", 0)) for _, m in run.hb.values()
                        if m.generation == run.generation] + [0])
        target = ((seen + 2 + every - 1) // every) * every
        if target >= run.spec.training.steps:
            return
        self.pausing = target
        for s in slots:
            s.handle.pause_at.remote(run.generation, target)
        self.reporter.event("growing", f"{pool.count(ReplicaState.READY)} spare replica(s) ready: pausing after "
                            f"step {target} to grow", step=target)

    # ----------------------------------------------------------------- stop
    def stop(self, slots: list[Slot], culprits: list[Slot]) -> None:
        """Every run call of the ending generation returns, or its worker is written off."""
        for s in culprits:
            self.pool.write_off(s, "failed")
        for s in slots:
            if s.dead is None:
                with contextlib.suppress(Exception):
                    s.handle.abort.remote(self.run.generation)
        deadline = time.monotonic() + self.timeout_s() + 10.0
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
                        s.result = RunResult(RunStatus.DEAD, s.name, self.run.generation, s.rank, 0,
                                             error=str(e))
                        s.dead = "died"
        for s in slots:
            if s.result is None and s.dead is None:
                s.dead = "could not leave its group in time"
                with contextlib.suppress(Exception):
                    ray.kill(s.handle, no_restart=True)

    def stop_all(self) -> None:
        """At a cancel: every active worker stops at its next step boundary (waited for briefly)."""
        slots = self.pool.active_slots()
        for s in slots:
            with contextlib.suppress(Exception):
                s.handle.abort.remote(10**9)
        deadline = time.monotonic() + 5.0
        refs = [s.run_ref for s in slots if s.run_ref is not None and s.result is None]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
