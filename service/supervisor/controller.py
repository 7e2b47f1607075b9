"""The supervisor's controller: the job's life as states that carry their data, one `step()` at a time.

    Starting | Adopting -> Running <-> Recovering(failure), Running <-> Resizing,
    Running -> Finished;  any -> Cancelled | Failed(reason)

`step()` runs the current state's work and moves to the state it returns; `run()` steps until a
final state has run. Every rule it applies comes from the policies it is given (service.policies).
The job states users see (service.state_machine) are reported by the states as they happen.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass

import ray

from service.autolayout import check_resize, cluster_for_job
from service.policies import FailureKind, Policies
from service.state_machine import JobState
from service.supervisor.committer import SnapshotCommitter
from service.supervisor.context import CancelRequested, JobFailed, JobRun
from service.supervisor.detection import Failure
from service.supervisor.generations import GenerationEnd, Generations
from service.supervisor.kept_notes import lines_from_workers, rows_from_workers
from service.supervisor.pool import ReplicaPool, ReplicaState, Slot, on_lost_nodes
from service.supervisor.recovery_clock import RecoveryTiming
from service.supervisor.reporter import Reporter
from service.text import plural
from workers.protocol import RunStatus

log = logging.getLogger("unbroken.supervisor")

_START_GRACE_S = 2.0
_SPARES_GRACE_S = 15.0  # how long a started group waits for its spares that are starting with it
_SURVIVOR_ROWS_S = 1.0  # how long a recovery waits for the survivors' rows not yet received (idle: ms)


@dataclass
class Starting:
    """A new job: reserve and start replicas, check the first node, launch generation 0."""


@dataclass
class Adopting:
    """This supervisor restarted: take over the job's live workers and re-form from the last state."""


@dataclass
class Running:
    """A generation trains; watched until it ends."""


@dataclass
class Recovering:
    failure: Failure


@dataclass
class Resizing:
    """The generation paused at a snapshot boundary: the next one re-forms at the target dp (spare
    replicas join, or the surplus leaves) and restores that snapshot from memory: no step is lost."""


@dataclass
class Finished:
    """Every rank finished."""


@dataclass
class Cancelled:
    """The user cancelled."""


@dataclass
class Failed:
    reason: str
    traceback: str | None = None


State = Starting | Adopting | Running | Recovering | Resizing | Finished | Cancelled | Failed
FINAL = (Finished, Cancelled, Failed)


class Controller:
    def __init__(self, run: JobRun, reporter: Reporter, pool: ReplicaPool, committer: SnapshotCommitter,
                 generations: Generations, policies: Policies) -> None:  # fmt: skip
        self.run = run
        self.reporter = reporter
        self.pool = pool
        self.committer = committer
        self.gens = generations
        self.policies = policies
        self.state: State = Adopting() if run.restarted else Starting()

    def run_to_end(self) -> None:
        """Step until a final state has done its work (reported the end)."""
        while True:
            prev = self.state
            self.step()
            if isinstance(prev, Failed) or (isinstance(prev, FINAL) and self.state is prev):
                return

    def step(self) -> None:
        """Do the current state's work; move to the next state."""
        try:
            self.state = self._dispatch(self.state)
        except JobFailed as e:
            self.state = Failed(str(e))
        except CancelRequested:
            self.state = Cancelled()
        except Exception as e:  # noqa: BLE001 - the job fails with the reason; the actor stays to say so
            self.state = Failed(f"supervisor error: {type(e).__name__}: {e}", traceback.format_exc())

    def _dispatch(self, state: State) -> State:
        match state:
            case Starting():
                return self._start()
            case Adopting():
                return self._adopt()
            case Running():
                return self._watch()
            case Recovering(failure=failure):
                return self._recover(failure)
            case Resizing():
                return self._resize()
            case Finished():
                self.reporter.to(JobState.FINISHING, "every rank finished")
                self.reporter.flush_metrics(force=True)
                steps = self.reporter.last_row_step
                self.reporter.conclude(JobState.SUCCEEDED, "finished", "finished", f"job finished: {steps} steps, "
                                       f"{self.run.recoveries} recovery(ies)", steps=steps,
                                       recoveries=self.run.recoveries)
                return state
            case Cancelled():
                self.gens.stop_all()
                self.reporter.conclude(JobState.CANCELLED, "cancelled", "cancelled", "job cancelled")
                return state
            case Failed(reason=reason, traceback=tb):
                self.reporter.fail(reason, tb)
                return state
        raise AssertionError(f"unknown controller state {state!r}")

    # ----------------------------------------------------------------- the states' work
    def _start(self) -> State:
        run, pool = self.run, self.pool
        self.reporter.event("started", f"The supervisor of job {run.job_id} started; the job's folder is "
                            f"{run.output_dir}.", dp_min=run.dp_min, dp_max=run.dp_max, model_parallel=run.mp,
                            output_dir=str(run.output_dir), checkpoint_uri=run.spec.checkpoint.uri)
        want = self.gens.target
        for _ in range(want):
            pool.request()
        deadline = time.monotonic() + run.ft.wait_for_capacity_s
        grace_until: float | None = None
        spares_until: float | None = None
        spares_at = time.monotonic() + _START_GRACE_S  # spares are asked for once the group is placed
        while True:
            run.check_cancel()
            pool.advance()
            if spares_at and (pool.count(ReplicaState.PENDING) == 0 or time.monotonic() >= spares_at):
                self.gens.fit_pool()  # the spares, each on the node holding the fewest of the group
                spares_at = 0.0
            ready = pool.count(ReplicaState.READY)
            if ready >= want:
                # Spares asked for with the group start with it: they are waited for a little (so the
                # group is chosen knowing where they are), never for capacity (a PENDING one is not).
                spares_until = spares_until or time.monotonic() + _SPARES_GRACE_S
                if pool.count(ReplicaState.STARTING) == 0 or time.monotonic() >= spares_until:
                    break
            if ready >= run.dp_min and pool.count(ReplicaState.STARTING) == 0:
                grace_until = grace_until or time.monotonic() + _START_GRACE_S
                if time.monotonic() >= grace_until:
                    break
            if time.monotonic() > deadline and pool.count(ReplicaState.STARTING) == 0:
                raise JobFailed(
                    f"only {ready} of the dp.min={run.dp_min} replica(s) ({run.mp} worker(s) each, "
                    f"{run.per_worker} per worker) could start within wait_for_capacity_s="
                    f"{run.ft.wait_for_capacity_s:g}; add capacity or lower resources.dp.min"
                )
            time.sleep(0.05)
        reps = pool.members(want)  # the rest: spares, on other nodes
        self.gens.probe(reps[0].slots[0])
        ck = run.spec.checkpoint
        self.gens.launch(0, reps, restore=ck.resume or bool(ck.resume_from))
        self.reporter.to(JobState.RUNNING, "workers started")
        return Running()

    def _adopt(self) -> State:
        """Take over after our own restart. The workers trained on while this supervisor was down, and
        the notes they sent meanwhile (metrics rows, snapshot acks) were lost with it; so the rows come
        back from the workers themselves (Worker.rows_after) and the snapshots from the keepers, which
        hold them (SnapshotCommitter.restore_target): the new generation restores the step the workers
        had reached, or the one before, not the last commit the crashed instance made."""
        run, pool, reporter = self.run, self.pool, self.reporter
        t_detect = time.time()
        reporter.event("supervisor_restarted", "the supervisor restarted; finding the job's workers")
        done = reporter.stored_recoveries()
        if done is not None:  # the count goes on (max_recoveries holds across our restarts)
            run.recoveries = max(run.recoveries, done)
        last_gen, lost = pool.adopt()
        slots = [s for r in pool.in_state(ReplicaState.READY) for s in r.slots]
        rows = rows_from_workers(run, reporter, self.gens, slots)
        lines = lines_from_workers(reporter, slots)
        reached = max([int((s.info or {}).get("step") or 0) for s in slots] + [reporter.last_row_step])
        with run.lock:
            run.last_step_seen = max(run.last_step_seen, reached)
        gone = (f"; rank(s) {', '.join(map(str, lost))} of it died while the supervisor was down (their workers, "
                "or their node, are gone): the new generation goes on without them" if lost else "")
        reporter.event("adopted", f"found {len(slots)} live worker(s) of generation {last_gen}, which had reached "
                       f"step {reached}; {plural(rows, 'metrics row')} and {plural(lines, 'output line')} they "
                       f"sent while the supervisor was down came back from them{gone}", generation=last_gen,
                       step=reached, rows_recovered=rows, lines_recovered=lines, recoveries=run.recoveries,
                       lost_ranks=lost)
        run.generation = last_gen
        dp = self._choose_dp()
        if dp is None:
            dp = self._wait_for_capacity()
        reps = self.pool.in_state(ReplicaState.READY)[:dp]
        self.gens.fit_pool()
        t_launch = time.time()
        self.gens.launch(last_gen + 1, reps, restore=True)
        # Timed and told like a recovery (one `recovered` event), its lost steps counted from `reached`.
        reporter.recoveries.begin(RecoveryTiming(
            kind="supervisor_restarted", cause="a restart of the supervisor", t_fault=None, t_detect=t_detect,
            t_launch=t_launch, last_step=reached, generation=run.generation))
        reporter.to(JobState.RUNNING, "re-formed after a supervisor restart")
        return Running()

    def _watch(self) -> State:
        end = self.gens.watch()
        if end is GenerationEnd.FINISHED:
            return Finished()
        if end is GenerationEnd.CANCELLED:
            return Cancelled()
        if end is GenerationEnd.PAUSED:
            return Resizing()
        assert isinstance(end, Failure)
        return Recovering(end)

    def _recover(self, failure: Failure) -> State:
        run, pool, reporter = self.run, self.pool, self.reporter
        failure = self._behind_broken_collective(failure)
        t_detect = failure.t_detect
        earlier = reporter.recoveries.close()  # one still replaying ends here; an interrupted one goes on below
        old_dp, old_gen = run.dp, run.generation
        last_step = run.last_step_seen
        decision = self.policies.failures.decide(failure.kind, run.recoveries, failure.step)
        reporter.event("failure_detected", failure.detail, kind=failure.kind.value, generation=old_gen,
                       workers=[s.name for s in failure.slots], ranks=[s.rank for s in failure.slots],
                       step=last_step, recover=decision.recover,
                       detect_s=(t_detect - failure.t_fault) if failure.t_fault else None)
        if not decision.recover:  # deterministic (a start-up error, the same step failing again): no recovery
            self.gens.stop(pool.active_slots(), failure.slots)
            raise JobFailed(f"{failure.detail.rstrip('.')}; not recovering: {decision.reason}")
        reporter.to(JobState.RECOVERING, failure.detail)
        run.recoveries += 1
        from workers import telemetry

        telemetry.record_recovery(run.job_id, failure.kind.value)
        self.gens.pausing = None
        active = pool.in_state(ReplicaState.ACTIVE)
        slots = [s for r in active for s in r.slots]
        self.gens.stop(slots, failure.slots)
        for s in slots:  # a rank whose own step raised (not a broken collective) is replaced
            res = s.result
            if s.dead is None and res is not None and res.status == RunStatus.ERROR and not res.collective:
                log.warning("%s (rank %s) is replaced: its step raised %s", s.name, s.rank, (res.error or "")[-600:])
                pool.kill(s, "its step raised")
        lost = [rep.index for rep in active if any(s.dead is not None for s in rep.slots)]
        for rep in active:
            if rep.index in lost:
                pool.drop(rep, "lost a member")
            else:
                rep.state = ReplicaState.READY
        # Rows the survivors hold that have not reached us (rank 0's last one may still be in its agent's
        # batch) are written now: a snapshot is restored only up to the last row written, so the target
        # can be the newest snapshot whole on the keepers rather than the one before it (a replayed step).
        survivors = [s for rep in active if rep.index not in lost for s in rep.slots]
        rows_from_workers(run, reporter, self.gens, survivors, timeout_s=_SURVIVOR_ROWS_S)
        # A pod's processes die one by one: Ray can tell of a rank's death while its node's raylet still
        # answers. So a death's node is looked at again now (one probe, not the cluster's): if it is gone,
        # the group's other ranks there are gone with it and must not be launched into the next generation.
        on_lost: list[Slot] = []
        if failure.kind == FailureKind.NODE_DIED:
            on_lost = failure.slots
        elif failure.kind == FailureKind.WORKER_DIED:
            on_lost = on_lost_nodes(failure.slots)
        lost_nodes = {str((s.info or {}).get("node_id")) for s in on_lost}
        members = {rep.index for rep in active}
        if lost_nodes:  # the survivors are READY by now: those on a lost node are dropped with its spares
            pool.drop_ready_on_gone_nodes(lost_nodes, members=members)
        spares_before = [r.index for r in pool.in_state(ReplicaState.READY) if r.index not in members]
        dp = self._choose_dp()
        if dp is None:
            dp = self._wait_for_capacity()
        if dp < old_dp:
            self._check_resize_fits(dp)
        reps = pool.members(dp, keep=members)
        t_launch = time.time()
        reporter.pauses.formed_for(old_gen + 1, failure.kind.value)
        self.gens.launch(old_gen + 1, reps, restore=True)
        if dp != old_dp:
            reporter.event("resized", f"dp {old_dp} -> {dp} (world {old_dp * run.mp} -> {dp * run.mp})",
                           old_dp=old_dp, new_dp=dp, generation=run.generation, cause=failure.kind.value)
        self.gens.spares.tell_swap([r for r in reps if r.index in spares_before], lost, old_dp, dp)
        reporter.recoveries.begin(RecoveryTiming(
            kind=failure.kind.value, cause=failure.cause(), t_fault=failure.t_fault, t_detect=t_detect,
            t_launch=t_launch, last_step=last_step, generation=run.generation,
            failed=tuple(s.name for s in failure.slots), failed_generation=old_gen).after(earlier))
        self.gens.fit_pool()  # replacements (a new spare) come once the new generation completed a step
        reporter.to(JobState.RUNNING, f"re-formed at dp={dp}")
        return Running()

    def _resize(self) -> State:
        """Re-form at the target dp after the pause: the paused step's snapshot is committed first, so
        the next generation restores exactly it from memory (0 steps lost, also when shrinking)."""
        run, pool, gens = self.run, self.pool, self.gens
        self.reporter.to(JobState.RESIZING, "resizing")
        active = pool.in_state(ReplicaState.ACTIVE)
        # The step the ranks paused after: the agreed one, or later when the request reached them late.
        steps = [int(s.result.step) for r in active for s in r.slots if s.result is not None]
        old_dp, paused = run.dp, max(steps, default=gens.pausing)
        gens.pausing = None
        self._await_commit(paused)
        pool.drop_ready_on_gone_nodes()  # a node lost during the pause: grow without its replica
        ready = pool.in_state(ReplicaState.READY)
        new_dp = min(gens.target, len(active) + len(ready))
        if new_dp < len(active):
            self._check_resize_fits(new_dp)
            for rep in active[new_dp:]:  # the last replicas leave; their capacity goes back to the cluster
                pool.drop(rep, f"released at dp={new_dp}")
            reps = active[:new_dp]
        else:  # ready replicas join; those left out (on other nodes where possible) stay as spares
            reps = pool.members(new_dp, keep=[r.index for r in active])
        restored = self.committer.committed
        cause = "scheduler" if gens.target_reason else "growth"
        self.reporter.pauses.formed_for(run.generation + 1, cause)
        gens.launch(run.generation + 1, reps, restore=True)
        gens.fit_pool()
        lost = None if paused is None or restored is None else max(0, paused - restored[1])
        why = f": {gens.target_reason}" if gens.target_reason else ""
        change = f"dp {old_dp} -> {new_dp} (world {old_dp * run.mp} -> {new_dp * run.mp}) at step {paused}{why}" \
            if new_dp != old_dp else f"dp stays {new_dp} at step {paused}{why}: the replicas to take in were lost " \
            "during the pause"
        self.reporter.event("resized", f"{change}; {lost if lost is not None else '?'} step(s) lost",
                            old_dp=old_dp, new_dp=new_dp, generation=run.generation, cause=cause,
                            reason=gens.target_reason or None, step=paused, lost_steps=lost)
        how = "grown" if new_dp > old_dp else "shrunk" if new_dp < old_dp else "re-formed"
        self.reporter.to(JobState.RUNNING, f"{how} to dp={new_dp}")
        return Running()

    # ----------------------------------------------------------------- helpers
    def _behind_broken_collective(self, failure: Failure) -> Failure:
        """A broken collective that names no culprit: the peers' errors came before any word of what
        broke it. A lost node is the usual cause, and Ray may take many seconds to say so (the ranks it
        took then hold up `stop` until the collective timeout). Its agent's silence says it sooner: wait
        for the node agents' word up to their timeout, and name the node (its ranks are the culprits,
        written off at once). Without agents, or when they say nothing, the broken collective stands."""
        agents = self.gens.agents
        if (failure.kind != FailureKind.COLLECTIVE_ERROR or failure.slots or agents is None
                or not self.gens.agents_on):
            return failure
        from service.supervisor.agents import confirm_silent, dead_in_ray

        running = [s for s in self.pool.active_slots() if s.result is None and s.dead is None]
        if not running:
            return failure
        deadline = time.monotonic() + agents.timeout_s + 0.5
        while time.monotonic() < deadline:
            self.run.check_cancel()
            now = time.time()
            silent = agents.silent(now)
            silent += [x for x in dead_in_ray(agents, now) if x[0] not in {n for n, _ in silent}]
            found = self.gens.detector.from_agents(agents.take_lost(), confirm_silent(agents, silent),
                                                   running, now)
            if found is not None:
                found.detail = f"{found.detail} Its peers saw a broken collective first: {failure.detail}"
                found.t_detect = failure.t_detect
                return found
            time.sleep(0.1)
        return failure

    def _choose_dp(self) -> int | None:
        """The dp the ready replicas allow, capped at the scheduler's target; None below dp.min."""
        dp = self.policies.scaling.choose(self.pool.count(ReplicaState.READY))
        return None if dp is None else min(dp, max(self.gens.target, self.run.dp_min))

    def _await_commit(self, step: int | None, timeout_s: float = 15.0) -> None:
        """Until the snapshot of the paused step is committed (its acknowledgements may trail the ranks'
        return), so the next generation restores it rather than an older one."""
        deadline = time.monotonic() + timeout_s
        while step is not None and time.monotonic() < deadline:
            self.committer.commit()
            done = self.committer.committed
            if done is not None and done[1] >= step:
                return
            time.sleep(0.05)

    def _check_resize_fits(self, dp: int) -> None:
        """The planner's memory check at the smaller dp (a bigger share of the fixed global batch and
        of the model states per rank): fail with the reason rather than run out of memory."""
        try:
            cluster = cluster_for_job(self.run.spec, ray.cluster_resources()).cluster
            reasons = check_resize(self.run.spec, dp, cluster)
        except Exception as e:  # a job or cluster the planner cannot model: say so and go on
            self.reporter.event("resize_check", f"memory not re-checked at dp={dp}: {e}", dp=dp, fits=None)
            return
        if reasons:
            raise JobFailed(f"shrinking to dp={dp} would not fit in memory: {'; '.join(reasons[:3])}")
        self.reporter.event("resize_check", f"dp={dp} still fits in memory (planner)", dp=dp, fits=True)

    def _wait_for_capacity(self) -> int:
        """Below dp.min: wait for replacements up to wait_for_capacity_s, then fail."""
        run, pool = self.run, self.pool
        wait = run.ft.wait_for_capacity_s
        alive = pool.count(ReplicaState.READY)
        self.reporter.event("waiting_for_capacity",
                            f"{alive} replica(s) alive, below dp.min={run.dp_min}; waiting up to {wait:g}s",
                            alive=alive, dp_min=run.dp_min)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            run.check_cancel()
            self.gens.fit_pool()
            pool.advance()
            dp = self._choose_dp()
            if dp is not None:
                return dp
            time.sleep(0.2)
        raise JobFailed(
            f"below dp.min={run.dp_min}: only {pool.count(ReplicaState.READY)} replica(s) of {run.mp} worker(s) "
            f"alive after waiting wait_for_capacity_s={wait:g}; add capacity or lower resources.dp.min"
        )
