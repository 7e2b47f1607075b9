"""The supervisor's side of the node agents (workers.node_agent): one NodeBatch per node per interval.

A batch updates the job's shared state as its ranks' own notes would have (step timings for the
straggler policy, snapshot acks for the committer, the relayed rare notes through the actor's inbox),
and the tracker keeps what the supervisor watches per node instead of per rank: when each agent was
last heard from (a node whose agent falls silent for `timeout_s` is lost, before Ray's health check
says so), the newest step and slowest step time seen, and the ranks the agents saw lost. Every call
is O(1) per node, plus O(ranks on the node) only for the data a batch carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.supervisor.context import JobRun
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


@dataclass
class AgentTracker:
    run: JobRun
    on_ack: Callable[[int, int, int, int, bool], None]  # the committer's (generation, step, rank, world, ok)
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
        if b.node in self.seen or not self.seen:
            self.seen[b.node] = max(now, self.seen.get(b.node, now))
        for n, t in b.members.items():  # a leader's batch: its members as it last heard them
            if n != b.node and n in self.seen:
                self.seen[n] = now - max(0.0, b.time - t)
        for n, t in b.lost_nodes.items():
            if n not in self.lost_nodes and self.event is not None:
                self.event("agent_lost", f"The agent of node {n} fell silent ({b.time - t:.1f}s), seen by the agent of "
                           f"node {b.node}, its group's leader: node {n} is lost.", node=n, leader=b.node,
                           silent_s=round(b.time - t, 3))
            self.lost_nodes.setdefault(n, t)
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
            for r in ranks:
                self.on_ack(gen, step, r, world, True)
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

    def heartbeat_ages(self, now: float) -> dict[str, float]:
        """worker -> seconds since its agent last heard from it (for the heartbeat-age gauge)."""
        with self.run.lock:
            return {w: max(0.0, now - t) for beats in self.beats.values() for w, t in beats.items()}


# ===================================================================== the agents' actors (Ray)
def start_agents(tracker: AgentTracker, slots: list[Any], generation: int, timeout_s: float = 30.0) -> dict[str, Any]:
    """An agent on each node of `slots` (created once per job and node, found by name after a supervisor
    restart), told which of its node's workers are which rank in `generation`; returns {node: agent}.
    Raises on a node whose agent does not answer within timeout_s (the caller goes on without agents)."""
    import time

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from checkpointing.keeper import node_ids_by_name
    from checkpointing.naming import agent_name
    from workers.node_agent import NodeAgent, agent_groups

    run = tracker.run
    by_node: dict[str, list[Any]] = {}
    for s in slots:
        by_node.setdefault(str((s.info or {}).get("node_name")), []).append(s)
    ids = node_ids_by_name()
    cls = ray.remote(NodeAgent)
    for node in sorted(by_node):
        if node not in tracker.handles:
            if node not in ids:
                raise ValueError(f"node {node} is not alive")
            tracker.handles[node] = cls.options(
                name=agent_name(run.job_id, node), namespace=run.namespace, lifetime="detached",
                get_if_exists=True, num_cpus=0, max_concurrency=16, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ids[node], soft=False),
            ).remote(agent_name(run.job_id, node), node, run.self_handle, tracker.interval_s,
                     run.ft.heartbeat_timeout_s)
    refs = [tracker.handles[node].own.remote([(s.name, s.rank, generation, (s.info or {}).get("pid"), s.handle)
                                              for s in group]) for node, group in by_node.items()]
    groups = agent_groups(list(by_node))
    for leader, members in groups.items():  # the tree: members send to their leader, leaders here
        patience = tracker.interval_s * tracker.member_misses
        refs.append(tracker.handles[leader].set_upstream.remote(None, members, patience))
        refs += [tracker.handles[m].set_upstream.remote(tracker.handles[leader], [], patience)
                 for m in members if m != leader]
    ray.get(refs, timeout=timeout_s)
    with run.lock:
        tracker.expect(sorted(by_node), time.time(), reporters=sorted(groups))
    return {n: tracker.handles[n] for n in by_node}



def confirm_silent(tracker: AgentTracker, silent: list[tuple[str, float]], timeout_s: float = 1.0,
                   ) -> list[tuple[str, float]]:  # fmt: skip
    """Of the nodes found silent, those whose agent does not answer a ping within timeout_s. An agent
    starved on a loaded host answers late, but answers; a lost node's never does. Those that answer
    count as heard from now."""
    import time

    import ray

    refs = {n: tracker.handles[n].ping.remote() for n, _ in silent if n in tracker.handles}
    if not refs:
        return silent
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    alive = set()
    for n, ref in refs.items():
        if ref in ready:
            try:
                ray.get(ref, timeout=0.001)
                alive.add(n)
            except Exception:  # noqa: BLE001, S112 - a dead agent's ping fails: its node is lost
                continue
    if alive:
        now = time.time()
        with tracker.run.lock:
            for n in alive:
                tracker.seen[n] = now
                tracker.lost_nodes.pop(n, None)
    return [(n, t) for n, t in silent if n not in alive]
