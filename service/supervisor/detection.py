"""Failure detection: what ended a worker's run call, silent workers (hangs), stragglers, and which
of a generation's failures is the root cause.

Chaos faults are named by their kind (the worker's `fault` note arrives before it acts).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from service.policies import FailureKind, StragglerPolicy
from service.supervisor.context import JobRun
from service.supervisor.pool import Slot, on_lost_nodes
from service.supervisor.reporter import Reporter
from service.supervisor.words import cause_phrase, first_line
from workers.chaos import STOPS_ITS_RANK, fault_place
from workers.protocol import FaultNote, Note, RankLost, RunResult, RunStatus


@dataclass
class Failure:
    kind: FailureKind
    slots: list[Slot]
    detail: str
    t_detect: float
    t_fault: float | None = None
    step: int | None = None

    def cause(self) -> str:
        return cause_phrase(self.kind, [s.rank for s in self.slots])


def root_cause(found: list[Failure]) -> Failure:
    """Peers of the failed rank fail too (their collectives break): name the cause, not them.

    A failure of a rank's own (its step raised, it died, it hung) outranks every broken collective;
    among those, the lowest rank's, so the same failures always name the same cause."""
    def order(f: Failure) -> tuple[bool, int]:
        return f.kind == FailureKind.COLLECTIVE_ERROR, min((s.rank for s in f.slots), default=1 << 30)

    return min(found, key=order)


_SETTLE_NODES_S = 0.25  # while settling a broken collective, the pending ranks' nodes are checked this often


class FailureDetector:
    def __init__(self, run: JobRun, reporter: Reporter, stragglers: StragglerPolicy) -> None:
        self.run = run
        self.reporter = reporter
        self.stragglers = stragglers
        self._names: tuple[tuple[int, int], set[str]] = ((-2, -1), set())

    def settle(self, found: list[Failure], pending: list[Slot], grace_s: float) -> list[Failure]:
        """`found` holds only broken collectives: the rank that broke them is still returning (its own
        error is sent after it left the group, so its peers' errors can arrive first). Wait up to
        grace_s for the other run calls of the generation, and add what they report."""
        if not pending or any(f.kind != FailureKind.COLLECTIVE_ERROR for f in found):
            return found
        deadline = time.monotonic() + grace_s
        more = list(found)
        while pending and time.monotonic() < deadline:
            # A rank on a lost node may not return for seconds (until Ray knows): its node's raylet says it.
            lost = self._on_lost_nodes(pending)
            if lost is not None:  # its fault: the first broken collective it caused, where a rank said when
                lost.t_fault = min((f.t_fault for f in more if f.t_fault), default=None)
                more.append(lost)
                break
            done, _ = ray.wait([s.run_ref for s in pending], num_returns=1,
                               timeout=max(0.0, min(_SETTLE_NODES_S, deadline - time.monotonic())))
            for s in [s for s in pending if s.run_ref in done]:
                pending.remove(s)
                f = self.collect(s)
                if f is not None:
                    more.append(f)
            if any(f.kind != FailureKind.COLLECTIVE_ERROR for f in more):
                break
        return more

    def _on_lost_nodes(self, slots: list[Slot]) -> Failure | None:
        """The ranks of `slots` whose node is gone (checkpointing.nodes), as one node failure; else None."""
        gone = on_lost_nodes(slots)
        if not gone:
            return None
        nodes = ", ".join(sorted({str((s.info or {}).get("node_name", "?")) for s in gone}))
        ranks = ", ".join(str(s.rank) for s in gone[:8]) + (" ..." if len(gone) > 8 else "")
        return Failure(FailureKind.NODE_DIED, gone, f"Node {nodes} is lost (its raylet is gone; ranks {ranks}).",
                       time.time())

    def death(self, s: Slot, e: BaseException) -> Failure:
        """Ray says `s`'s actor died: the failure, its cause first (chaos, its node, or Ray's words)."""
        s.result = RunResult(RunStatus.DEAD, s.name, self.run.generation, s.rank, 0, error=str(e))
        s.dead = "died"
        kind = FailureKind.NODE_DIED if self._node_dead(s) else FailureKind.WORKER_DIED
        return Failure(kind, [s], self._death_text(s, kind, e), time.time(), t_fault=self._fault_time(s))

    def collect(self, s: Slot) -> Failure | None:
        """Read a finished run call; a failure when it did not end well."""
        try:
            s.result = ray.get(s.run_ref)
        except ActorUnavailableError:
            return None  # suspect, not dead: heartbeats decide
        except (ActorDiedError, RayActorError) as e:
            return self.death(s, e)
        res = s.result
        if res.ok:
            return None
        if res.status == RunStatus.ERROR:
            formed = s.name in self.run.formed
            kind = (FailureKind.COLLECTIVE_ERROR if res.collective
                    else FailureKind.STEP_ERROR if formed else FailureKind.BUILD_ERROR)
            return Failure(kind, [s] if kind != FailureKind.COLLECTIVE_ERROR else [],
                           f"{s.name} (rank {s.rank}): {first_line(res.error or '')}",
                           time.time(), t_fault=res.time, step=res.step)
        return Failure(FailureKind.COLLECTIVE_ERROR, [], f"{s.name} (rank {s.rank}) stopped: {res.status}",
                       time.time())

    def hung(self, slots: list[Slot], hbs: dict[str, tuple[float, Note]], now: float) -> Failure | None:
        """The first running worker silent for over heartbeat_timeout_s."""
        hb_timeout = self.run.ft.heartbeat_timeout_s
        for s in slots:
            if s.result is not None:
                continue
            seen = hbs.get(s.name, (None, None))[0]
            if seen is not None and now - seen > hb_timeout:
                fault = self.fault_of(s)
                cause = f" (hung by chaos: {fault.kind})" if fault else ""
                return Failure(FailureKind.HANG, [s], f"Rank {s.rank} ({s.short}) sent no heartbeat "
                               f"for {now - seen:.1f}s{cause}; heartbeat_timeout_s={hb_timeout:g}.", now,
                               t_fault=seen)
        return None

    def from_agents(self, lost: list[RankLost], silent: list[tuple[str, float]], slots: list[Slot],
                    now: float) -> Failure | None:  # fmt: skip
        """What the node agents saw (service.supervisor.agents): a rank lost on its node (its process
        exited or stopped, or it fell silent), or a node whose agent fell silent (the node is lost).
        O(1) while all is well; the slots are searched only once something is wrong."""
        if not lost and not silent:
            return None
        by_name = {s.name: s for s in slots if s.result is None}
        for x in lost:
            if x.kind == "died" and x.t_fault is not None and x.generation < self.run.generation:
                self.reporter.recoveries.fault_seen(x.worker, x.generation, x.t_fault)  # Ray told of it first
                continue
            s = by_name.get(x.worker)
            if s is None or x.generation != self.run.generation:
                continue
            fault = self.fault_of(s)
            t_fault = fault.time if fault else x.t_fault
            if x.kind == "died":  # in the words of Ray's own report of a death (the cause first)
                kind = FailureKind.NODE_DIED if self._node_dead(s) else FailureKind.WORKER_DIED
                return Failure(kind, [s], self._death_text(s, kind, x.detail), now, t_fault=t_fault)
            cause = f" (hung by chaos: {fault.kind})" if fault else ""
            if x.kind == "stopped":  # seen in its process's state, before any heartbeat was missed
                what = "hangs: its process is stopped"
            else:
                silent = f"sent no heartbeat for {now - x.t_fault:.1f}s" if x.t_fault is not None else x.detail
                what = f"{silent}{cause}; heartbeat_timeout_s={self.run.ft.heartbeat_timeout_s:g}"
                cause = ""
            return Failure(FailureKind.HANG, [s], f"Rank {s.rank} ({s.short}) {what}{cause} (seen by its node's agent).",
                           now, t_fault=t_fault)
        for node, seen in silent:
            gone = [s for s in by_name.values() if (s.info or {}).get("node_name") == node]
            if gone:
                ranks = ", ".join(str(s.rank) for s in gone[:8]) + (" ..." if len(gone) > 8 else "")
                return Failure(FailureKind.NODE_DIED, gone, f"Node {node} is lost: its agent sent nothing for "
                               f"{max(0.0, now - seen):.1f}s (ranks {ranks}).", now, t_fault=seen)
        return None

    def check_stragglers(self, slots: list[Slot]) -> Failure | None:
        """Complete steps' timings to the straggler policy: a failure when it says replace, else events."""
        run = self.run
        key = (run.generation, len(slots))
        if self._names[0] != key:  # a generation's slots are fixed: their names are built once
            self._names = (key, {s.name for s in slots})
        names = self._names[1]
        with run.lock:
            # The length first: an incomplete step costs O(1), a complete one O(ranks) once.
            complete = sorted(st for st, rep in run.step_reports.items()
                              if len(rep["gap"]) >= len(names) and rep["gap"].keys() >= names)
            reports = [run.step_reports.pop(st) for st in complete]
        for rep in reports:
            for name in self.stragglers.observe(rep["gap"], rep["time"]):
                s = next(x for x in slots if x.name == name)
                msg = (f"{name} (rank {s.rank}) is a straggler: its own time per step is over "
                       f"{self.stragglers.factor:g}x the median")
                if self.stragglers.replaces:
                    return Failure(FailureKind.STRAGGLER, [s], msg, time.time())
                self.reporter.event("straggler", msg, worker=name, rank=s.rank, action="warn")
        return None

    def _node_dead(self, s: Slot) -> bool:
        """Whether the node of a rank that died is gone too (checkpointing.nodes: Ray's table or its raylet)."""
        return bool(on_lost_nodes([s]))

    def _fault_time(self, s: Slot) -> float | None:
        f = self.fault_of(s)
        return f.time if f else None

    def fault_of(self, s: Slot) -> FaultNote | None:
        """The chaos fault that fired in this worker's current generation and stops a rank, if any (a
        slow_worker's pacing note is not the cause of a death that follows it)."""
        with self.run.lock:
            for f in reversed(self.run.faults):
                if f.worker == s.name and f.generation == self.run.generation and f.kind in STOPS_ITS_RANK:
                    return f
        return None

    def _death_text(self, s: Slot, kind: FailureKind, e: BaseException | str) -> str:
        """One sentence, the cause first: chaos by name; a node loss; else Ray's first line."""
        who = f"Rank {s.rank} ({s.short} on node {(s.info or {}).get('node_name', '?')})"
        fault = self.fault_of(s)
        if fault is not None:
            return f"{who} was stopped by chaos ({fault.kind} {fault_place(fault.at, fault.step)})."
        if kind == FailureKind.NODE_DIED:
            return f"{who} was lost with its node."
        return f"{who} died: {first_line(e)}"
