"""The supervisor's side of the node agents (workers.node_agent): one NodeBatch per node per interval.

A batch updates the job's shared state as its ranks' own notes would have (step timings for the
straggler policy, snapshot acks for the committer, the relayed rare notes through the actor's inbox),
and the tracker keeps what the supervisor watches per node instead of per rank: when each agent was
last heard from, the newest step and slowest step time seen, and the ranks the agents saw lost. Every
call is O(1) per node, plus O(ranks on the node) only for the data a batch carries.

A node whose agent falls silent (for `timeout_s` here, or as its group leader saw it) is a suspect,
not yet lost: on a loaded host a healthy agent's threads can be starved for seconds. `judge` writes a
suspect off when Ray's node table says its node is dead, when its agent is gone (a ping fails), or when
its agent has not answered a ping for the patience, a multiple of the longest gap recently seen between
batches (workers.node_agent.Patience). An agent that answers was slow, not lost: it counts as heard
from, and the patience grows with its silence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.supervisor.context import JobRun
from service.supervisor.ray_poll import ready_now
from workers.node_agent import Patience
from workers.protocol import NodeBatch, Note, RankLost

AGENT_INTERVAL_S = 0.25  # an agent's batch interval (it sends at once when a rank is lost)
AGENT_MISSES = 3  # batches an agent may miss before its node counts as lost (the design: 0.75 s)
# The service's own supervisors wait longer for a silent agent: on a loaded machine (our 2-core test
# hosts run dozens of processes) a healthy agent's thread can be starved for over a second, and a
# node written off by mistake costs a recovery. 2 s still beats Ray's node death with default
# health checks (~14 s, NOTES.md); scale_bench shows the 0.75 s design.
SERVICE_AGENT_MISSES = 8
# A group leader writes off a silent member's node sooner (4 intervals: 1 s, inside Ray's 1.4 s with the
# health-check settings of NOTES.md): a mistake there needs a member's agent starved for a second.
SERVICE_MEMBER_MISSES = 4
# The least time a suspect's agent has to answer a ping before its node is written off without Ray's
# word; more on a loaded host (Patience: 3x the longest recent gap between batches).
PING_PATIENCE_S = 1.0
NODE_TABLE_EVERY_S = 0.5  # Ray's node table is read at most this often, and only while there are suspects
# An agent this many batches late has its node checked (checkpointing.nodes: Ray's table, its raylet's
# port): a node whose raylet is gone is written off then, not after the silence above.
LATE_MISSES = 1


@dataclass
class Suspect:
    node: str
    since: float  # when its agent was last heard of
    found: float  # when it became a suspect
    leader: str | None  # the group leader that found it silent (None: found silent here)


@dataclass
class AgentTracker:
    run: JobRun
    on_ack: Callable[..., None]  # the committer's (generation, step, rank, world, ok, acked nodes)
    relay: Callable[[Note], None]  # the actor's inbox, for the rare notes a batch carries unchanged
    add_logs: Callable[[str, list[Any]], None] | None = None  # the reporter's (source, [(t, stream, line)])
    event: Callable[..., None] | None = None  # the reporter's: a node lost as its group's leader saw it
    interval_s: float = AGENT_INTERVAL_S
    misses: int = AGENT_MISSES
    member_misses: int = AGENT_MISSES  # a group leader's patience with a silent member
    seen: dict[str, float] = field(default_factory=dict)  # node -> when its agent was last heard of
    reporters: set[str] = field(default_factory=set)  # nodes whose agents send here (group leaders)
    lost_nodes: dict[str, float] = field(default_factory=dict)  # found silent by their leader, not yet taken
    last_seq: dict[str, int] = field(default_factory=dict)
    beats: dict[str, dict[str, float]] = field(default_factory=dict)  # node -> worker -> last heard (agent's clock)
    lost: list[RankLost] = field(default_factory=list)  # ranks the agents saw lost, not yet taken
    max_step: int = 0
    max_step_time_s: float = 0.0
    batches: int = 0
    handles: dict[str, Any] = field(default_factory=dict)  # node -> its agent actor (service only)
    # node -> the Ray node id its agent was started on: a node lost and back under the same name (a
    # raylet started again on its host) is a new Ray node, and its old agent went with the old one
    handle_ids: dict[str, str] = field(default_factory=dict)
    lost_by: dict[str, str] = field(default_factory=dict)  # node in lost_nodes -> the leader that found it silent
    suspects: dict[str, Suspect] = field(default_factory=dict)  # silent nodes not yet written off (judge)
    patience: Patience = field(default_factory=lambda: Patience(PING_PATIENCE_S))
    false_alarms: int = 0  # suspects whose agent answered
    pings: dict[str, Any] = field(default_factory=dict)  # node -> its agent's outstanding ping (service only)
    _node_table: tuple[float, set[str]] = (-1e18, set())  # (when read, the names of dead nodes)
    _hb_synced: dict[str, float] = field(default_factory=dict)  # node -> when its ranks' run.hb was updated

    @property
    def timeout_s(self) -> float:
        return self.interval_s * self.misses

    def expect(self, nodes: list[str], now: float, reporters: list[str] | None = None) -> None:
        """A generation starts on these nodes, whose `reporters` (group leaders; default: all) send here:
        each reporter's silence counts from now."""
        for n in nodes:
            self.seen[n] = max(self.seen.get(n, 0.0), now)
        for n in [n for n in self.seen if n not in set(nodes)]:
            self.forget(n)
        self.reporters = set(nodes if reporters is None else reporters)
        self.lost_nodes.clear()
        self.lost_by.clear()
        self.suspects.clear()
        self.pings.clear()

    def forget(self, node: str) -> None:
        for d in (self.seen, self.last_seq, self.beats):
            d.pop(node, None)  # type: ignore[attr-defined]

    def on_batch(self, b: NodeBatch, now: float) -> None:
        """One node's batch (call under the run's lock)."""
        run = self.run
        self.batches += 1
        # No batch is dropped for coming late: the supervisor is a threaded actor, so Ray may run an
        # agent's batch n+1 before batch n, and each carries acks and metrics rows of its own.
        self.last_seq[b.node] = max(b.seq, self.last_seq.get(b.node, 0))
        if b.node in self.reporters and b.node in self.seen:  # how late batches come: the patience's measure
            self.patience.observe(now - self.seen[b.node], now)
        if b.node in self.seen or not self.seen:
            self.seen[b.node] = max(now, self.seen.get(b.node, now))
        for n, t in b.members.items():  # a leader's batch: its members as it last heard them
            if n != b.node and n in self.seen:
                self.seen[n] = now - max(0.0, b.time - t)
        for n, t in b.lost_nodes.items():
            if n not in self.lost_nodes and self.event is not None:
                self.event("agent_silent", f"The agent of node {n} fell silent ({b.time - t:.1f}s), seen by the agent "
                           f"of node {b.node}, its group's leader: checking whether node {n} is lost.", node=n,
                           leader=b.node, silent_s=round(b.time - t, 3))
            self.lost_nodes.setdefault(n, t)
            self.lost_by.setdefault(n, b.node)
        self.beats[b.node] = b.beats
        if now - self._hb_synced.get(b.node, -1e18) >= 1.0:  # once a second a node: the gauge's rate
            self._hb_synced[b.node] = now
            hb = run.hb
            for w, t in b.beats.items():  # each rank as last heard by its agent, on this clock
                prev = hb.get(w)
                hb[w] = (now - max(0.0, b.time - t), prev[1] if prev is not None else b)
        if b.rank_logs and self.add_logs is not None:
            by_source: dict[str, list[Any]] = {}
            for t, source, line in b.rank_logs:
                by_source.setdefault(source, []).append((t, "stdout", line))
            for source, lines in by_source.items():
                self.add_logs(source, lines)
        if b.generation == run.generation:
            for step, timings in b.steps.items():
                rep = run.step_reports.setdefault(step, {"gap": {}, "time": {}})
                gap, time_ = rep["gap"], rep["time"]
                for w, (g, t) in timings.items():
                    gap[w] = g
                    time_[w] = t
            self.max_step = max(self.max_step, b.max_step)
            self.max_step_time_s = max(self.max_step_time_s, b.max_step_time_s)
            self.lost.extend(x for x in b.lost if x.generation == run.generation)
        for (gen, step), ranks in b.acks.items():
            world = b.ack_world[(gen, step)]
            held = b.ack_held.get((gen, step), {})
            for r in ranks:
                self.on_ack(gen, step, r, world, True, held.get(r))
        for note in b.notes:
            self.relay(note)

    def take_lost(self) -> list[RankLost]:
        with self.run.lock:
            out, self.lost = self.lost, []
        return out

    def silent(self, now: float) -> list[tuple[str, float]]:
        """(node, last heard) of the lost nodes: those a leader found silent, and the reporters (leaders)
        silent here for over timeout_s."""
        limit = self.timeout_s
        with self.run.lock:
            out = sorted(self.lost_nodes.items())
            seen = self.seen
            out += [(n, seen[n]) for n in self.reporters if n in seen and now - seen[n] > limit
                    and n not in self.lost_nodes]
            return out

    def judge(self, silent: list[tuple[str, float]], now: float, pings: dict[str, str],
              dead_nodes: set[str]) -> list[tuple[str, float]]:  # fmt: skip
        """Of the silent nodes (`silent()`), those to write off now: Ray's node table says the node is dead
        (`dead_nodes`: the names it lists as dead and not also alive; empty: not known), its agent's ping failed
        (`pings[node]` 'died'), or it has not answered ('pending', or 'none': no agent to ask) for the
        patience. 'answered': the agent was slow, not lost; it counts as heard from now. Call from one
        thread (the watch loop); each node is written off once."""
        heard = {n for n, _ in silent}
        for n in [n for n in self.suspects if n not in heard]:  # heard from again meanwhile
            del self.suspects[n]
        patience = self.patience.limit(now)
        out: list[tuple[str, float]] = []
        for n, since in silent:
            s = self.suspects.get(n)
            if s is None:
                s = self.suspects[n] = Suspect(n, since, now, self.lost_by.get(n))
            outcome = pings.get(n, "none")
            # Ray's node table before a ping's answer: a ping answered just before the node went (its
            # agent outlives its raylet for a moment) is not a slow node, and must not raise the patience.
            if n in dead_nodes:
                why = "the node is gone (Ray's node table says so, or its raylet refuses connections)"
            elif outcome == "answered":
                self._answered(s, now)
                continue
            elif outcome == "died":
                why = "its agent is gone (Ray says the actor died)"
            elif now - s.found > patience:
                why = f"its agent did not answer a ping for {now - s.found:.1f}s (patience {patience:.1f}s)"
            else:
                continue
            out.append((n, since))
            if self.event is not None:
                by = f", seen by the agent of node {s.leader}, its group's leader" if s.leader else ""
                self.event("agent_lost", f"Node {n} is lost: its agent fell silent {now - since:.1f}s ago{by}, and "
                           f"{why}.", node=n, leader=s.leader, silent_s=round(now - since, 3), reason=why)
        return out

    def _answered(self, s: Suspect, now: float) -> None:
        del self.suspects[s.node]
        self.false_alarms += 1
        self.patience.observe(now - s.since, now)  # a silence this long was not a loss: wait longer next time
        with self.run.lock:
            if s.node in self.seen:
                self.seen[s.node] = now
            self.lost_nodes.pop(s.node, None)
            self.lost_by.pop(s.node, None)
        if self.event is not None:
            self.event("agent_answered", f"The agent of node {s.node} answered after {now - s.since:.1f}s of silence: "
                       f"the node was slow, not lost; patience now {self.patience.limit(now):.1f}s.", node=s.node,
                       silent_s=round(now - s.since, 3), patience_s=round(self.patience.limit(now), 3))

    def heartbeat_ages(self, now: float) -> dict[str, float]:
        """worker -> seconds since its agent last heard from it (for the heartbeat-age gauge)."""
        with self.run.lock:
            return {w: max(0.0, now - t) for beats in self.beats.values() for w, t in beats.items()}


# ===================================================================== the agents' actors (Ray)
def agent_handle(tracker: AgentTracker, node: str, node_id: str) -> Any:
    """The job's agent on `node` (Ray node id `node_id`): created once per job and node, found by name
    when it exists (after a supervisor restart, or started ahead for a hot spare's node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from checkpointing.naming import agent_name
    from workers.node_agent import NodeAgent

    run = tracker.run
    return ray.remote(NodeAgent).options(
        name=agent_name(run.job_id, node), namespace=run.namespace, lifetime="detached",
        get_if_exists=True, num_cpus=0, max_concurrency=16, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(agent_name(run.job_id, node), node, run.self_handle, tracker.interval_s, run.ft.heartbeat_timeout_s)


def current_agent(tracker: AgentTracker, node: str, node_id: str) -> tuple[Any, bool]:
    """(the job's agent on `node`, whether it was started now): the one the tracker holds if it was made
    on this Ray node, else a new one, recorded (a node lost and back under its name is a new Ray node)."""
    if node in tracker.handles and tracker.handle_ids.get(node) == node_id:
        return tracker.handles[node], False
    tracker.handles[node] = agent_handle(tracker, node, node_id)
    tracker.handle_ids[node] = node_id
    return tracker.handles[node], True


def start_agents(tracker: AgentTracker, slots: list[Any], generation: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """An agent on each node of `slots` (created once per job and node, found by name after a supervisor
    restart), told which of its node's workers are which rank in `generation`; returns {node: agent}.
    Raises on a node whose agent does not answer within timeout_s (the caller goes on without agents)."""
    import time

    import ray

    from checkpointing.nodes import node_ids_by_name
    from workers.node_agent import agent_groups

    run = tracker.run
    by_node: dict[str, list[Any]] = {}
    for s in slots:
        by_node.setdefault(str((s.info or {}).get("node_name")), []).append(s)
    ids = node_ids_by_name()
    for node in sorted(by_node):
        if node in ids:
            current_agent(tracker, node, ids[node])
        elif node not in tracker.handles:
            raise ValueError(f"node {node} is not alive")
    refs = [tracker.handles[node].own.remote([(s.name, s.rank, generation, s.pid, s.handle)
                                              for s in group]) for node, group in by_node.items()]
    groups = agent_groups(list(by_node))
    for leader, members in groups.items():  # the tree: members send to their leader, leaders here
        patience = tracker.interval_s * tracker.member_misses
        refs.append(tracker.handles[leader].set_upstream.remote(None, members, patience))
        refs += [tracker.handles[m].set_upstream.remote(tracker.handles[leader], [], patience, leader)
                 for m in members if m != leader]
    ray.get(refs, timeout=timeout_s)
    with run.lock:
        tracker.expect(sorted(by_node), time.time(), reporters=sorted(groups))
    return {n: tracker.handles[n] for n in by_node}



def confirm_silent(tracker: AgentTracker, silent: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """Of the nodes found silent, those to write off now (AgentTracker.judge), asking Ray: each suspect's
    agent gets a ping (answered on a later call if not at once: this never blocks the watch loop), and
    Ray's node table is read while there are suspects. A lost node's agent never answers; a starved one
    answers late."""
    import time

    import ray
    from ray.exceptions import ActorUnavailableError

    if not silent and not tracker.suspects:
        return []
    now = time.time()
    pings: dict[str, str] = {}
    for n, _ in silent:
        if n in tracker.handles and n not in tracker.pings:
            with contextlib.suppress(Exception):  # a dead handle fails below, when its ping is read
                tracker.pings[n] = tracker.handles[n].ping.remote()
    for n in [n for n in tracker.pings if n not in {m for m, _ in silent}]:
        tracker.pings.pop(n)  # heard from again
    refs = list(tracker.pings.values())
    ready = ready_now(refs)
    for n, ref in list(tracker.pings.items()):
        if ref not in ready:
            pings[n] = "pending"
            continue
        del tracker.pings[n]  # read once; a new ping goes out on the next call if need be
        try:
            ray.get(ref, timeout=0.001)
            pings[n] = "answered"
        except ActorUnavailableError:  # Ray's "suspect, not dead" (NOTES.md): ask again
            pings[n] = "pending"
        except Exception:  # noqa: BLE001 - the actor died (with its node, or alone)
            pings[n] = "died"
    dead = _dead_nodes(tracker, now) if silent else tracker._node_table[1]
    return tracker.judge(silent, now, pings, dead)


def _dead_nodes(tracker: AgentTracker, now: float) -> set[str]:
    """The generation's nodes that are gone (checkpointing.nodes: Ray's node table, or a raylet that
    refuses connections), read at most every NODE_TABLE_EVERY_S; empty when the GCS does not answer."""
    from checkpointing.nodes import dead_node_names

    when, dead = tracker._node_table
    if now - when >= NODE_TABLE_EVERY_S:
        with tracker.run.lock:
            names = sorted(tracker.seen, key=lambda n: tracker.seen[n])  # the longest silent first
        try:
            dead = dead_node_names(names)
        except Exception:  # noqa: BLE001 - the GCS busy: judge on the pings alone
            dead = set()
        tracker._node_table = (now, dead)
    return dead


def late_and_gone(tracker: AgentTracker, now: float, silent: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """`silent` plus the (node, last heard) of reporters over LATE_MISSES batches late whose node is
    already known to be gone; nothing is read from Ray while every agent is on time."""
    with tracker.run.lock:
        late = {n for n in tracker.reporters if n in tracker.seen
                and now - tracker.seen[n] > tracker.interval_s * LATE_MISSES}
    late -= {n for n, _ in silent}
    if not late:
        return silent
    return silent + [x for x in dead_in_ray(tracker, now) if x[0] in late]


def dead_in_ray(tracker: AgentTracker, now: float) -> list[tuple[str, float]]:
    """(node, last heard) of the generation's nodes known to be gone (see _dead_nodes). After a broken
    collective that names no culprit, a lost node need not first stay silent for timeout_s: its raylet
    refuses connections at once, Ray's health check knows in about 1.4 s (NOTES.md)."""
    dead = _dead_nodes(tracker, now)
    with tracker.run.lock:
        return [(n, tracker.seen[n]) for n in sorted(dead) if n in tracker.seen]
