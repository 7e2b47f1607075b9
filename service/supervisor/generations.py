"""One generation at a time: start it (ranks, keepers, restore target, the rank-0 store), watch it
until it ends, stop it.

`watch` returns how the generation ended: a `GenerationEnd` or the `Failure` that ended it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from enum import Enum
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from service.policies import FailureKind, ScalingPolicy
from service.supervisor.agents import AgentTracker
from service.supervisor.committer import SnapshotCommitter
from service.supervisor.context import JobFailed, JobRun
from service.supervisor.detection import Failure, FailureDetector, root_cause
from service.supervisor.node_helpers import NodeHelpersAhead
from service.supervisor.pool import LIVE, Replica, ReplicaPool, ReplicaState, Slot
from service.supervisor.reporter import Reporter
from service.supervisor.spares import Spares
from service.supervisor.upload_wait import UploadWait
from service.supervisor.words import first_line, restore_phrase
from service.text import plural
from workers import telemetry
from workers.protocol import Heartbeat, RunResult, RunStatus

log = logging.getLogger("unbroken.supervisor")

_POLL_S = 0.05
# How long a broken collective waits for the failure of a rank's own that broke it (see settle).
_ROOT_CAUSE_GRACE_S = 3.0
# A new worker's start-up (imports, engine) takes the cores a re-form's first step needs: replacements and
# spares are asked for, and granted ones spawned, once the re-formed generation (after a recovery, a grow,
# a shrink) completed a step, or after this long at most (a big model's step may take minutes).
REPLACE_AFTER_REFORM_S = 10.0
_NODES_CHECK_S = 0.5  # while stopping, pending ranks' nodes are checked this often (checkpointing.nodes)


class GenerationEnd(Enum):
    FINISHED = "finished"    # every rank trained to the last step
    PAUSED = "paused"        # every rank paused at the agreed step: to resize (grow, or shrink to the target)
    CANCELLED = "cancelled"  # the user cancelled


def rank_of(replica_pos: int, local: int, dp: int, cp_tp: int) -> int:
    """The global rank of a replica's `local`-th worker, for the mesh order pp, dp, cp, tp.

    A replica is one model-parallel group (tp x pp x cp workers, placed together): its workers share
    the dp coordinate `replica_pos`; local // cp_tp is their pp stage, local % cp_tp their cp x tp place.
    """
    return (local // cp_tp) * (dp * cp_tp) + replica_pos * cp_tp + (local % cp_tp)


class Generations:
    def __init__(self, run: JobRun, reporter: Reporter, pool: ReplicaPool, committer: SnapshotCommitter,
                 detector: FailureDetector, scaling: ScalingPolicy, agents: AgentTracker | None = None) -> None:  # fmt: skip
        self.run = run
        self.agents = agents  # the node agents' side (service.supervisor.agents); None: ranks report here
        self._agents_on = False  # this generation's ranks report through their node agents
        self.reporter = reporter
        self.pool = pool
        self.committer = committer
        self.detector = detector
        self.scaling = scaling
        self._launch_failure: Failure | None = None  # launch could not form the generation
        self.pausing: int | None = None  # the step the current generation pauses after, to resize
        # The dp the job should run at: dp.max unless the scheduler asked for less (resize_to). Replicas
        # beyond it are released; a generation above it pauses at its next snapshot and re-forms smaller.
        self.target: int = run.dp_max
        self.target_reason: str = ""
        self.spares = Spares(run, pool, reporter, agents)  # the warm spares: watched, counted, told
        self._positions: dict[int, int] = {}  # replica index -> its dp position in the last generation
        self.ahead = NodeHelpersAhead(run, agents, reporter.event)  # helpers where replicas wait to join
        ck = run.spec.checkpoint
        self.upload_wait = UploadWait(run.job_id, ck.persist_every, ck.in_memory_every)  # resizes after uploads

    def set_target(self, dp: int, reason: str) -> None:
        run = self.run
        if not run.dp_min <= dp <= run.dp_max:
            raise ValueError(f"dp={dp} is outside the job's resources.dp range {run.dp_min}..{run.dp_max}")
        self.target, self.target_reason = dp, reason

    def fit_pool(self) -> None:
        """Replicas to the target plus the spares wanted: ask for the missing ones (they start when
        capacity allows; a spare on the node with the fewest of the job's replicas), release those not
        needed (a reservation first, a ready spare last; active ones leave at a pause)."""
        pool = self.pool
        if not self.may_start_workers():
            return
        live = pool.count(*LIVE)
        while live < self.target:
            pool.request()
            live += 1
        if live < self.target + self.spares.wanted:
            hint = pool.spare_node_hint()
            while live < self.target + self.spares.wanted:
                pool.request(prefer_node=hint)
                live += 1
        surplus = live - max(self.target, pool.count(ReplicaState.ACTIVE)) - self.spares.wanted
        for state in (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY):
            for rep in reversed(pool.in_state(state)):
                if surplus <= 0:
                    return
                pool.drop(rep, f"not needed at dp={self.target}")
                surplus -= 1

    def may_start_workers(self) -> bool:
        """Whether a new worker may start now (asked for by fit_pool, or spawned into granted room): not
        while a re-form's generation has completed no step, up to REPLACE_AFTER_REFORM_S."""
        return self.reporter.pauses.reforming_for() >= REPLACE_AFTER_REFORM_S

    def timeout_s(self) -> float:
        from workers.collective_timeout import collective_timeout_s

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
    def _in_place(self, reps: list[Replica]) -> list[Replica]:
        """At an unchanged dp (a spare swap), the last generation's replicas keep their data-parallel
        positions and the newcomers take the free ones: every survivor keeps its ranks, so it restores its
        own shards (held by the keeper on its own node) and only the replaced ranks change."""
        old = self._positions
        if len(reps) != len(old) or not any(r.index in old for r in reps):
            return reps
        placed: list[Replica | None] = [None] * len(reps)
        for r in reps:
            if r.index in old:
                placed[old[r.index]] = r
        new = iter(r for r in reps if r.index not in old)
        return [p if p is not None else next(new) for p in placed]

    def launch(self, generation: int, reps: list[Replica], *, restore: bool) -> None:
        run = self.run
        reps = self._in_place(reps)
        self._positions = {r.index: d for d, r in enumerate(reps)}
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
            run.models_before = {w: (int(m.restored.get("pid", -1)), int(m.restored.get("model_id", -1)))
                                 for w, m in run.formed.items()}
            run.formed.clear()
            run.step_reports.clear()
        self.detector.stragglers.reset()
        self.committer.keeper_set.ensure(slots)
        target = self.committer.restore_target() if restore else None
        if generation == 0 and restore and target == {"step": None, "generation": None}:
            target = {"step": None, "generation": None, "resume": True}  # a persistent checkpoint, if any
        if generation > 0:
            self.committer.fence(generation)  # after choosing the target: it may be of an older generation
        timeout = self.timeout_s()
        rank0 = next(s for s in slots if s.rank == 0)
        assert rank0.info is not None
        try:
            port = ray.get(rank0.handle.open_store.remote(generation, world, timeout), timeout=60)
        except (RayActorError, GetTimeoutError) as e:  # rank 0 lost while the group forms: a failure
            self._launch_failed(slots, rank0, e)
            return
        host = rank0.info["host"]
        keepers = self.committer.keepers
        agents = self._start_agents(slots, generation)
        for s in slots:
            s.run_ref = s.handle.run.remote(generation, s.rank, world, host, port, dp, restore=target,
                                            timeout_s=timeout, keepers=keepers or None,
                                            agent=agents.get(str((s.info or {}).get("node_name"))))
        spares = self.spares.count_at_launch()
        telemetry.record_group(run.job_id, dp, generation, spares=spares)
        self.reporter.event("generation", f"Generation {generation} starts with {plural(world, 'worker')} at "
                            f"dp={dp}" + restore_phrase(target) + ".",
                            generation=generation, dp=dp, world_size=world,
                            restore=target and {k: v for k, v in target.items() if k != "known"},
                            ranks={s.name: s.rank for s in slots}, keepers=sorted(keepers), agents=sorted(agents),
                            nodes=sorted({r.node_name or "?" for r in reps}),
                            **({"spares": spares} if self.spares.wanted else {}))

    def _launch_failed(self, slots: list[Slot], rank0: Slot, e: BaseException) -> None:
        """Rank 0 died or stopped answering before the generation could form (e.g. killed during a
        recovery): no rank starts, and `watch` returns this failure so the controller recovers again."""
        gen = self.run.generation
        for s in slots:  # nothing runs: `stop` waits for none of them
            s.result = RunResult(RunStatus.ABORTED, s.name, gen, s.rank, 0)
        if isinstance(e, GetTimeoutError):
            self._launch_failure = Failure(FailureKind.HANG, [rank0], f"Rank 0 ({rank0.short}) did not open the "
                                           f"group's store within 60 s for generation {gen}.", time.time())
        else:
            self._launch_failure = self.detector.death(rank0, e)

    def _start_agents(self, slots: list[Slot], generation: int) -> dict[str, Any]:
        """The generation's node agents, {node: agent}; {} without them (the ranks then report here)."""
        self._agents_on = False
        if self.agents is None:
            return {}
        from service.supervisor.agents import start_agents

        try:
            agents = start_agents(self.agents, slots, generation)
        except Exception as e:  # noqa: BLE001 - the job runs on without agents, as before them
            self.reporter.event("agents_missing", f"node agents could not start ({first_line(e)}); the ranks "
                                "report to the supervisor directly")
            return {}
        self._agents_on = True
        return agents

    @property
    def agents_on(self) -> bool:
        """Whether this generation's ranks report through their node agents (which then watch them)."""
        return self._agents_on

    # ----------------------------------------------------------------- watch
    def watch(self) -> GenerationEnd | Failure:
        """Until the generation ends: finished, paused for growth, cancelled, or a failure."""
        run = self.run
        if self._launch_failure is not None:
            failure, self._launch_failure = self._launch_failure, None
            return failure
        while True:
            if run.cancel.is_set():
                return GenerationEnd.CANCELLED
            self.committer.commit()  # flushes the metrics rows first
            self.committer.keeper_set.watch()
            self.reporter.maybe_flush_logs()
            self.pool.advance(spawn=self.may_start_workers())  # room a dead worker freed waits too
            self.ahead.start(self.pool.waiting(), self.pool.active_nodes)
            self.spares.tell()
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
            if self._agents_on and self.agents is not None:  # the agents watch their ranks: O(nodes) here
                from service.supervisor.agents import confirm_silent, late_and_gone

                silent = confirm_silent(self.agents, late_and_gone(self.agents, now, self.agents.silent(now)))
                hung = self.detector.from_agents(self.agents.take_lost(), silent, slots, now)
            else:
                hung = self.detector.hung(slots, hbs, now)
            if hung is not None:
                return hung
            self.reporter.export_heartbeat_ages(slots, hbs, now)
            f = self.detector.check_stragglers(slots)
            if f is not None:
                return f
            self.fit_pool()
            self._maybe_pause_to_resize(slots)

    def _maybe_pause_to_resize(self, slots: list[Slot]) -> None:
        """Pause at the next snapshot boundary when the generation should re-form: smaller, because the
        target dropped below its dp; or bigger, when spare replicas are ready up to the target."""
        run, pool = self.run, self.pool
        if self.pausing is not None or self.reporter.recoveries.current is not None:
            return  # a pause is agreed already / the recovering generation first completes a step
        if self.target < run.dp:
            why = f"shrinking to dp={self.target}" + (f" ({self.target_reason})" if self.target_reason else "")
        else:
            if run.dp >= self.target or pool.count(ReplicaState.READY) == 0:
                return
            ready_for = time.monotonic() - min(r.since for r in pool.in_state(ReplicaState.READY))
            if not self.scaling.grow_now(pool.count(ReplicaState.STARTING), ready_for):
                return  # more replicas are on their way: grow once, with all of them, unless they are slow
            if min(self.scaling.wants_growth(run.dp, pool.count(ReplicaState.READY)), self.target - run.dp) <= 0:
                return
            if not self.ahead.ready([r.node_name for r in pool.in_state(ReplicaState.READY) if r.node_name]):
                return  # train on while their nodes' keeper and agent start, not inside the pause
            why = f"{pool.count(ReplicaState.READY)} spare replica(s) ready: growing"
        every = run.spec.checkpoint.in_memory_every or run.spec.checkpoint.persist_every or 1
        with run.lock:
            beats = [m for _, m in run.hb.values() if m.generation == run.generation]
        seen = max([int(getattr(m, "step", 0)) for m in beats] + [0])
        target = ((seen + 2 + every - 1) // every) * every
        if self.upload_wait.holds(beats, seen, target, why):
            return
        if target >= run.spec.training.steps:
            return  # the job ends first, and frees everything
        self.pausing = target
        self._to_ranks(slots, "pause_at", run.generation, target)
        self.reporter.event("growing" if self.target > run.dp else "shrinking",
                            f"pausing after step {target}: {why}", step=target, dp=run.dp, target_dp=self.target)

    def _to_ranks(self, slots: list[Slot], call: str, *args: Any) -> None:
        """A command (abort, pause_at) to the generation's ranks: through their node agents while they
        run (one call a node, workers.node_agent relays it), else to each rank."""
        targets = list(self.agents.handles.values()) if self._agents_on and self.agents is not None else []
        targets = targets or [s.handle for s in slots]
        for h in targets:
            with contextlib.suppress(Exception):
                getattr(h, call).remote(*args)

    # ----------------------------------------------------------------- stop
    def stop(self, slots: list[Slot], culprits: list[Slot]) -> None:
        """Every run call of the ending generation returns, or its worker is written off."""
        for s in culprits:
            self.pool.write_off(s, "failed")
        # The other ranks on a culprit's node, if that node is gone: written off now (SIGKILLed where they
        # are local), so their peers' collectives break now, not when those processes find their raylet gone.
        gen = self.run.generation
        self.pool.write_off_on_lost_nodes([s for s in slots if s.dead is None], gen,
                                          among={str((s.info or {}).get("node_id")) for s in culprits})
        self._to_ranks([s for s in slots if s.dead is None], "abort", gen)
        deadline = time.monotonic() + self.timeout_s() + 10.0
        unavailable: set[str] = set()  # slots whose run call ended "unavailable": its ref says no more
        nodes_checked = time.monotonic()
        while time.monotonic() < deadline:
            pending = [s for s in slots if s.result is None and s.dead is None]
            if not pending:
                break
            waiting = [s for s in pending if s.name not in unavailable]
            if waiting:
                done = set(ray.wait([s.run_ref for s in waiting], num_returns=len(waiting), timeout=0.2)[0])
            else:
                done = set()
                time.sleep(0.2)
            for s in waiting:
                if s.run_ref in done:
                    try:
                        s.result = ray.get(s.run_ref)
                    except ActorUnavailableError:
                        s.suspect_since = s.suspect_since or time.monotonic()
                        unavailable.add(s.name)
                    except (ActorDiedError, RayActorError) as e:
                        s.result = RunResult(RunStatus.DEAD, s.name, self.run.generation, s.rank, 0,
                                             error=str(e))
                        s.dead = "died"
            if time.monotonic() - nodes_checked >= _NODES_CHECK_S:
                # A rank on a lost node answers nothing (or "unavailable", which its ref keeps saying):
                # checkpointing.nodes knows the node is gone, this wait's deadline would be many seconds late.
                nodes_checked = time.monotonic()
                self.pool.write_off_on_lost_nodes([s for s in pending if s.result is None and s.dead is None], gen)
        for s in slots:
            if s.result is None and s.dead is None:
                s.dead = "could not leave its group in time"
                log.warning("%s (rank %s) is replaced: it did not return from its generation's run in time",
                            s.name, s.rank)
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
