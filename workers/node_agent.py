"""The node agent: one per node and job (`job-<id>/agent-<node>`), owning that node's ranks.

Ranks send their notes (workers.protocol) to their node's agent instead of to the supervisor; the
agent folds them into one `NodeBatch` per interval, so the supervisor handles one message per node
per interval whatever the ranks per node. The agent also watches its ranks from up close:

    died   the rank's process is gone (or a zombie): seen at the next check (CHECK_S), sent at once
    hang   the rank's process is stopped (SIGSTOP: state T), or silent for heartbeat_timeout_s
    node   the agent itself goes with its node: the supervisor sees its batches stop (and Ray's
           node death), see service.supervisor.agents

and relays the supervisor's commands (abort, pause) to its ranks. `NodeAggregator` is the whole of
the folding and watching, with no Ray in it (the scale simulation runs it as it is); `NodeAgent` is
the Ray actor around it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from workers.protocol import FaultNote, Heartbeat, NodeBatch, Note, RankLost, SnapshotAck

log = logging.getLogger("unbroken.agent")

CHECK_S = 0.1  # how often the agent looks at its ranks' processes
# Agents form a tree: up to FANIN nodes' agents send their batches to their group's leader (one of
# them), which sends one batch for the group. A Ray call costs its receiver ~0.2 ms of CPU here
# (scale_bench measures it), so 1,250 nodes' batches 4 times a second would take a core.
FANIN = 16
# Silence that counts, on a loaded host: a multiple of the longest gap recently seen between a peer's
# messages, so a machine where every thread is starved for a second (load 40-90 on 2 cores) raises the
# bar for all, and a quiet one keeps the base. A long gap is forgotten with this half-life.
PATIENCE_FACTOR = 3.0
PATIENCE_HALF_LIFE_S = 60.0
PATIENCE_CEILING_S = 30.0
# A sync through a leader that has not answered within this asks whether the leader's node is gone (its
# raylet refuses connections): Ray says a lost node's actors are dead only after 1-2 s.
LEADER_CHECK_S = 0.25


@dataclass
class Patience:
    """How long a peer may be silent before it is suspect: `base_s`, or PATIENCE_FACTOR x the longest
    recent gap between its messages (decaying with PATIENCE_HALF_LIFE_S), at most PATIENCE_CEILING_S."""

    base_s: float
    factor: float = PATIENCE_FACTOR
    half_life_s: float = PATIENCE_HALF_LIFE_S
    ceiling_s: float = PATIENCE_CEILING_S
    worst_s: float = 0.0  # the longest gap seen, as of `at`
    at: float = 0.0

    def recent(self, now: float) -> float:
        """The longest gap seen, decayed to `now`."""
        return self.worst_s * 0.5 ** (max(0.0, now - self.at) / self.half_life_s)

    def observe(self, gap_s: float, now: float) -> None:
        if gap_s >= self.recent(now):
            self.worst_s, self.at = gap_s, now

    def limit(self, now: float) -> float:
        return min(max(self.ceiling_s, self.base_s), max(self.base_s, self.factor * self.recent(now)))


def agent_groups(nodes: list[str], fanin: int = FANIN) -> dict[str, list[str]]:
    """leader node -> its group's nodes (itself first): sorted nodes in runs of `fanin`."""
    if fanin < 1:
        raise ValueError(f"fanin={fanin}: must be >= 1 (nodes per agent group)")
    ordered = sorted(set(nodes))
    return {g[0]: g for g in (ordered[i : i + fanin] for i in range(0, len(ordered), fanin))}


@dataclass
class LocalRank:
    worker: str
    rank: int
    generation: int
    pid: int | None
    seen: float  # when the agent last heard from it (or was told to own it)
    handle: Any = None
    lost: bool = False
    alive_at: float | None = None  # the agent's last look that found its process alive


@dataclass
class _Pending:
    """What the next batch carries."""

    steps: dict[int, dict[str, tuple[float, float]]] = field(default_factory=dict)
    acks: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    ack_world: dict[tuple[int, int], int] = field(default_factory=dict)
    ack_held: dict[tuple[int, int], dict[int, list[str]]] = field(default_factory=dict)
    ack_failures: int = 0
    lost: list[RankLost] = field(default_factory=list)
    lost_nodes: dict[str, float] = field(default_factory=dict)
    member_beats: dict[str, float] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    logs: list[tuple[float, str, str]] = field(default_factory=list)  # (time, source, line)
    max_step: int = 0
    max_step_time_s: float = 0.0


class NodeAggregator:
    """Folds a node's rank notes into NodeBatch messages and finds its lost ranks (no Ray, no threads:
    the caller serialises calls)."""

    send_on_acks = True  # a batch goes at once when a snapshot's acks are all in (False: at the interval; the
    # scale bench compares both)

    def __init__(self, name: str, node: str, heartbeat_timeout_s: float) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s={heartbeat_timeout_s}: must be > 0 "
                             "(fault_tolerance.heartbeat_timeout_s)")
        self.name = name
        self.node = node
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.ranks: dict[str, LocalRank] = {}
        self.generation = -1
        self.seq = 0
        self._p = _Pending()
        self.members: dict[str, float] = {}  # as a group's leader: member node -> when its batch last came
        self.member_patience = Patience(0.0)
        self.written_off: dict[str, float] = {}  # members said lost -> last heard; watched again if heard again
        # Snapshot acks, to send a batch the moment a step's are all in: (generation, step) -> acks counted
        # (own ranks' and members'), the steps already sent at once, and each member's live ranks.
        self._acked: dict[tuple[int, int], int] = {}
        self._acks_done: set[tuple[int, int]] = set()
        self.member_ranks: dict[str, int] = {}

    def lead(self, members: list[str], now: float, timeout_s: float) -> None:
        """Lead a group: the members' agents send their batches here; one silent for over timeout_s is
        a lost node (said in the next batch, sent at once)."""
        self.members = {m: now for m in members if m != self.node}
        self.member_patience = Patience(timeout_s)
        self.written_off.clear()

    @property
    def member_timeout_s(self) -> float:
        return self.member_patience.base_s

    # ----------------------------------------------------------------- ownership
    def own(self, worker: str, rank: int, generation: int, pid: int | None, now: float, handle: Any = None) -> None:
        """This node's `worker` is `rank` in `generation` now (a new generation replaces the old)."""
        if generation > self.generation:
            self.generation = generation
            self._p.steps.clear()  # an older generation's timings mean nothing to the new one
            self._acked.clear()
            self._acks_done.clear()
            self.member_ranks.clear()  # members say theirs for the new generation in their next batch
        self.ranks[worker] = LocalRank(worker, rank, generation, pid, now, handle)

    def release(self, worker: str) -> None:
        self.ranks.pop(worker, None)

    def ranks_of(self, generation: int) -> list[int]:
        """The global ranks this node's ranks have in `generation` (its rendezvous: workers.group)."""
        return sorted(r.rank for r in self.ranks.values() if r.generation == generation)

    # ----------------------------------------------------------------- intake
    def collect(self, note: Note, now: float) -> bool:
        """A note from one of this node's ranks (or, to a leader, a member's batch); True when the batch
        should go now: a chaos fault is about to act (the supervisor names it as the cause only if its
        note comes first), a rank or node was lost, or a snapshot's acks are all in (its commit would
        otherwise wait up to an interval). Still O(nodes) messages a step: one more batch per agent per
        snapshot, and the interval restarts after it."""
        if isinstance(note, NodeBatch):
            return self._absorb(note, now)
        r = self.ranks.get(note.worker)
        if r is not None:
            r.seen = now
        p = self._p
        if note.logs:
            p.logs.extend((t, note.source, line) for t, _stream, line in note.logs)
            note.logs = []
        if isinstance(note, Heartbeat):
            last = note.last
            if last is not None and note.generation == self.generation:
                p.steps.setdefault(note.step, {})[note.worker] = (last.gap_s, last.step_time_s)
                if note.step > p.max_step:
                    p.max_step = note.step
                if last.step_time_s > p.max_step_time_s:
                    p.max_step_time_s = last.step_time_s
            acks, note.acks = note.acks, []  # folded here (a relayed metrics note does not carry them twice)
            if note.metrics is not None:
                p.notes.append(note)  # rank 0's metrics row: the supervisor writes it
            return any([self._ack(ack) for ack in acks])  # (a list: every ack folded)
        if isinstance(note, SnapshotAck):
            return self._ack(note)
        p.notes.append(note)  # Formed, CheckpointReport, FaultNote: rare, relayed as they are
        return isinstance(note, FaultNote)

    def _ack(self, note: SnapshotAck) -> bool:
        """Fold one snapshot ack; True when every rank answered for has answered (send now: the commit
        waits on it)."""
        p = self._p
        key = (note.generation, note.step)
        if note.ok:
            p.acks.setdefault(key, []).append(note.rank)
            p.ack_world[key] = note.world_size
            p.ack_held.setdefault(key, {})[note.rank] = list(note.acked)
        else:
            p.ack_failures += 1
            p.notes.append(note)  # rare: the supervisor counts it and keeps its errors
        return self._count_acks(key, 1)

    def _absorb(self, b: NodeBatch, now: float) -> bool:
        """A member's batch, folded into this leader's next one; True when it reports a loss."""
        if b.generation == self.generation:
            self.member_ranks[b.node] = b.ranks
        if b.node in self.members:
            self.member_patience.observe(now - self.members[b.node], now)
            self.members[b.node] = now
        elif b.node in self.written_off:  # it was slow, not lost (the supervisor confirms either way):
            self.member_patience.observe(now - self.written_off.pop(b.node), now)  # more patience from now
            self.members[b.node] = now
        p = self._p
        for step, timings in b.steps.items():
            p.steps.setdefault(step, {}).update(timings)
        for key, ranks in b.acks.items():
            p.acks.setdefault(key, []).extend(ranks)
            p.ack_world[key] = b.ack_world[key]
            p.ack_held.setdefault(key, {}).update(b.ack_held.get(key, {}))
        p.ack_failures += b.ack_failures
        p.max_step = max(p.max_step, b.max_step)
        p.max_step_time_s = max(p.max_step_time_s, b.max_step_time_s)
        p.member_beats.update(b.beats)
        p.lost.extend(b.lost)
        p.lost_nodes.update(b.lost_nodes)
        p.notes.extend(b.notes)
        p.logs.extend(b.rank_logs)
        answered = {key: len(ranks) for key, ranks in b.acks.items()}
        for n in b.notes:  # failed acks travel as notes: they are answers too
            if isinstance(n, SnapshotAck) and not n.ok:
                answered[(n.generation, n.step)] = answered.get((n.generation, n.step), 0) + 1
        acks_in = False
        for key, count in answered.items():
            acks_in = self._count_acks(key, count) or acks_in
        return acks_in or bool(b.lost or b.lost_nodes or any(isinstance(n, FaultNote) for n in b.notes))

    def answers_for(self) -> int | None:
        """The live ranks of the current generation this agent answers for: its own, and as a leader its
        members' (None until every member has said its count in this generation)."""
        own = sum(1 for r in self.ranks.values() if r.generation == self.generation and not r.lost)
        if any(m not in self.member_ranks for m in self.members):
            return None
        return own + sum(self.member_ranks[m] for m in self.members)

    def _count_acks(self, key: tuple[int, int], n: int) -> bool:
        """Count n answers for a snapshot; True the first time all ranks answered for have (send now)."""
        if not self.send_on_acks or key[0] != self.generation or key in self._acks_done:
            return False
        self._acked[key] = got = self._acked.get(key, 0) + n
        want = self.answers_for()
        if want is None or got < want:
            return False
        self._acks_done.add(key)
        del self._acked[key]
        for old in [k for k in self._acked if k[1] < key[1] - 16]:  # steps that never completed here
            del self._acked[old]
        if len(self._acks_done) > 64:
            self._acks_done = {k for k in self._acks_done if k[1] >= key[1] - 16}
        return True

    # ----------------------------------------------------------------- watching
    def check(self, now: float, state_of: Callable[[LocalRank], str]) -> bool:
        """Look at every owned rank; `state_of(rank)` says 'alive', 'gone' or 'stopped'. Returns True
        when a rank was found lost now (the caller sends a batch at once)."""
        found = False
        for r in self.ranks.values():
            if r.lost or r.generation < self.generation:
                continue
            state = state_of(r)
            if state in LOST_BY_STATE:
                kind, said = LOST_BY_STATE[state]
                detail = f"{r.worker} (rank {r.rank}): {said} (seen by {self.name})"
                # When it died is not known, only that it was alive at the last look: the detection it
                # counts is then an upper bound. A stopped rank stopped when it fell silent.
                t_fault = (r.alive_at if r.alive_at is not None else now) if state == "gone" else r.seen
            elif now - r.seen > self.heartbeat_timeout_s:
                kind = "hang"
                detail = (f"{r.worker} (rank {r.rank}) sent no note for {now - r.seen:.1f}s; "
                          f"heartbeat_timeout_s={self.heartbeat_timeout_s:g}")
                t_fault = r.seen
            else:
                r.alive_at = now
                continue
            r.lost = True
            self._p.lost.append(RankLost(r.worker, r.rank, r.generation, kind, detail, t_fault, now))
            found = True
        limit = self.member_patience.limit(now)
        for m, seen in list(self.members.items()):
            if now - seen > limit:
                self._p.lost_nodes[m] = seen
                del self.members[m]  # said once, watched again if its batches come back
                self.written_off[m] = seen
                found = True
        return found

    @property
    def urgent(self) -> bool:
        """A lost rank waits to be sent."""
        return bool(self._p.lost or self._p.lost_nodes)

    # ----------------------------------------------------------------- output
    def flush(self, now: float) -> NodeBatch:
        """Everything since the last batch, in one message (an empty batch is the agent's heartbeat)."""
        p, self._p = self._p, _Pending()
        self.seq += 1
        beats = {r.worker: r.seen for r in self.ranks.values()}
        beats.update(p.member_beats)
        members = {self.node: now, **self.members} if self.members else {}
        return NodeBatch(self.name, self.generation, -1, now, node=self.node, seq=self.seq, max_step=p.max_step,
                         max_step_time_s=p.max_step_time_s, steps=p.steps, acks=p.acks, ack_world=p.ack_world,
                         ack_held=p.ack_held,
                         ack_failures=p.ack_failures, beats=beats, lost=p.lost, notes=p.notes, rank_logs=p.logs,
                         members=members, lost_nodes=p.lost_nodes, ranks=self.answers_for() or 0)


# A process state (`process_state`) that loses its rank -> the loss's kind and what it says of the process
LOST_BY_STATE: dict[str, tuple[str, str]] = {"gone": ("died", "its process exited"), "stopped": ("stopped", "its process is stopped (SIGSTOP)")}


def process_state(pid: int | None) -> str:
    """'alive', 'gone' (exited, or a zombie) or 'stopped' (SIGSTOP, traced), from /proc."""
    if pid is None:
        return "alive"
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "alive"
        return "alive"  # no /proc here: alive as far as we can tell
    state = stat.rsplit(")", 1)[-1].split()[0]
    return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state, "alive")


class LeaderLost(Exception):
    """The group leader's agent is gone (dead, or on a node that is gone)."""


def _through_leader(ref: Any, leader_node: str | None, timeout_s: float) -> None:
    """Wait for a call to the group leader's agent; LeaderLost once the leader is known gone, however
    long Ray has yet to take to say so; TimeoutError after timeout_s."""
    import ray
    from ray.exceptions import RayActorError

    from checkpointing.nodes import dead_node_names

    deadline = time.monotonic() + timeout_s
    while True:
        if ray.wait([ref], timeout=LEADER_CHECK_S)[0]:
            try:
                ray.get(ref)
                return
            except RayActorError as e:  # dead, or unreachable (ActorUnavailableError): passed by either way
                raise LeaderLost(f"the group leader's agent is dead or unreachable ({type(e).__name__})") from e
        if leader_node is not None and dead_node_names([leader_node]):
            raise LeaderLost(f"the group leader's node {leader_node} is gone")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the group leader's agent on node {leader_node} did not answer in {timeout_s:.0f}s")


class NodeAgent:
    """The Ray actor (`job-<id>/agent-<node>`, on its node, threaded): ranks `report` to it; it sends
    `supervisor.report(NodeBatch)` every interval_s, and at once when a rank is lost."""

    def __init__(self, name: str, node: str, supervisor: Any, interval_s: float, heartbeat_timeout_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: must be > 0 (the agent's batch interval)")
        self.agg = NodeAggregator(name, node, heartbeat_timeout_s)
        self.supervisor = supervisor
        self.upstream = supervisor  # where batches go: the supervisor, or the group leader's agent
        self.leader_node: str | None = None  # the node of the group leader's agent, when it is the upstream
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        threading.Thread(target=self._send_loop, name="agent-send", daemon=True).start()
        threading.Thread(target=self._check_loop, name="agent-check", daemon=True).start()

    # ----------------------------------------------------------------- from the supervisor
    def own(self, ranks: list[tuple[str, int, int, int | None, Any]]) -> int:
        """(worker, rank, generation, pid, handle) of this node's ranks in a generation; returns how many."""
        now = time.time()
        with self._lock:
            for worker, rank, generation, pid, handle in ranks:
                self.agg.own(worker, rank, generation, pid, now, handle)
            return len(self.agg.ranks)

    def set_upstream(self, upstream: Any, members: list[str], member_timeout_s: float,
                     leader_node: str | None = None) -> None:  # fmt: skip
        """Send batches to `upstream` (the group leader's agent, on node `leader_node`; None: the
        supervisor) and lead `members` (the group's other nodes, when this agent is their leader)."""
        with self._lock:
            self.upstream = upstream if upstream is not None else self.supervisor
            self.leader_node = leader_node if upstream is not None else None
            self.agg.lead(members, time.time(), member_timeout_s)

    def local_ranks(self, generation: int) -> list[int]:
        """This node's ranks in `generation`: each of them asks before joining, so the node's lowest rank
        leads its node's two-level rendezvous (workers.group.rendezvous). The supervisor told this agent
        (`own`) before it started any rank's run, so every rank of the node gets the same answer."""
        with self._lock:
            return self.agg.ranks_of(generation)

    def release(self, workers: list[str]) -> None:
        with self._lock:
            for w in workers:
                self.agg.release(w)

    def abort(self, generation: int) -> None:
        """Relay: every owned rank stops generations up to `generation`."""
        for r in self._handles():
            with contextlib.suppress(Exception):
                r.handle.abort.remote(generation)

    def pause_at(self, generation: int, step: int) -> None:
        """Relay: every owned rank pauses after `step` of `generation` (to grow)."""
        for r in self._handles():
            with contextlib.suppress(Exception):
                r.handle.pause_at.remote(generation, step)

    def ping(self) -> str:
        return self.agg.node

    def process_states(self, pids: list[int]) -> dict[int, str]:
        """'alive', 'gone' or 'stopped' for each of this node's `pids`: warm spares, which no generation
        gives this agent to own (the supervisor's service.supervisor.spare_watch asks)."""
        return {pid: process_state(pid) for pid in pids}

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # ----------------------------------------------------------------- from the ranks
    def report(self, note: Note) -> None:
        with self._lock:
            urgent = self.agg.collect(note, time.time())
        if urgent:
            self._wake.set()

    def sync(self, timeout_s: float = 10.0) -> None:
        """Send what is pending now and return once the supervisor has taken it (through the leader when
        this agent has one). A rank calls it before its run returns, so a fast job's last rows and acks
        reach the supervisor before it sees the run end. A leader found gone (its actor dead, or its node:
        a node lost while the ranks paused to grow) is passed by: the batch goes to the supervisor, and
        the ranks' leave does not wait the 1-2 s Ray takes to call the leader dead. Later batches go there
        too, until the next generation's set_upstream names a leader again."""
        import ray  # the simulator drives this class's aggregator without Ray

        with self._lock:
            batch = self.agg.flush(time.time())
            upstream, leader = self.upstream, self.leader_node
        if upstream is not self.supervisor:
            try:
                _through_leader(upstream.report.remote(batch), leader, timeout_s)
                _through_leader(upstream.sync.remote(timeout_s), leader, timeout_s)
                return
            except LeaderLost as e:
                log.warning("%s: %s; its batches go to the supervisor", self.agg.node, e)
                with self._lock:
                    if self.upstream is upstream:  # (not if a new generation named another leader meanwhile)
                        self.upstream, self.leader_node = self.supervisor, None
        ray.get(self.supervisor.report.remote(batch), timeout=timeout_s)

    # ----------------------------------------------------------------- loops
    def _handles(self) -> list[LocalRank]:
        with self._lock:
            return [r for r in self.agg.ranks.values() if r.handle is not None]

    def _check_loop(self) -> None:
        while not self._stop.wait(CHECK_S):
            with self._lock:
                lost = self.agg.check(time.time(), lambda r: process_state(r.pid))
            if lost:
                self._wake.set()

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            with self._lock:
                batch = self.agg.flush(time.time())
            with contextlib.suppress(Exception):  # a missing supervisor must not stop the agent
                self.upstream.report.remote(batch)
