"""A job's helpers on a node (its snapshot keeper, its node agent), started ahead where ready replicas wait.

A generation that takes in a replica on a node new to the group (a grow onto a node that came back, a
spare or ready replica taken in by a recovery) needs that node's keeper and agent. Started at the
launch, they are two actor start-ups inside the pause (1.4 s and 1.8 s, one after the other, on the
2-core VM: goodput_bench's grow-back paused 5.1 s). They start as soon as Ray places the replica on
the node (beside its workers' own start-up), while the group trains on. Not once it is ready: a
recovery takes a ready spare at once, and its launch waited for helpers started then (a swap paused
1.28 s, 0.57 s of it for them). A grow waits (training) until they answer, up to AHEAD_WAIT_S
from when it would otherwise pause (not from their start: on a slow node the helpers start as slowly
as the replicas beside them, and a wait counted from their start was spent before the grow was due);
the launch then finds them (the agent in the tracker, the keeper by name). The keeper is not added to
the supervisor's keeper set here: one that holds no copies yet must not count towards a commit's copies.
Only a head start: when it fails, the launch starts them as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.supervisor.agents import AgentTracker, current_agent
from service.supervisor.context import JobRun
from service.supervisor.ray_poll import ready_now
from service.supervisor.words import first_line

AHEAD_WAIT_S = 10.0  # a grow waits this long at most for a node's helpers to answer, then goes ahead


@dataclass
class _Started:
    node_id: str
    at: float  # monotonic
    pings: list[Any] = field(default_factory=list)  # the helpers' first answers, pending or done
    what: list[str] = field(default_factory=list)  # "snapshot keeper", "node agent"
    told: bool = False  # their answer (or the wait given up) was said in an event
    asked: float | None = None  # monotonic: when a grow onto the node was first held for them


class NodeHelpersAhead:
    def __init__(self, run: JobRun, agents: AgentTracker | None, event: Callable[..., None]) -> None:
        self.run = run
        self.agents = agents
        self.event = event  # the reporter's
        self._started: dict[str, _Started] = {}  # node -> what was started there ahead
        self._asked: set[int] = set()  # replica indices whose nodes were seen to

    def start(self, replicas: list[tuple[int, str]], group_nodes: Callable[[], set[str]]) -> None:
        """Start the keeper and agent on the nodes of these (replica index, node) pairs that the group
        does not use (`group_nodes()`: where it runs, its launch started them); cheap when none of the
        replicas is new (Ray's node table is read only for new ones)."""
        new = [(i, n) for i, n in replicas if i not in self._asked]
        if not new:
            return
        self._asked.update(i for i, _ in new)
        busy = group_nodes()
        new = [(i, n) for i, n in new if n not in busy]
        if not new:
            return
        nodes = sorted({n for _, n in new})
        try:
            self._start(nodes)
        except Exception as e:  # noqa: BLE001 - only a head start: the launch starts them itself
            for n in nodes:
                self.event("helpers_late", f"The snapshot keeper and node agent of node {n} could not be started "
                           f"ahead ({first_line(e)}); the launch that takes its replicas in starts them.",
                           node=n, late=True)

    def _start(self, nodes: list[str]) -> None:
        from checkpointing.keepers import start_keeper
        from checkpointing.nodes import node_ids_by_name

        ids = node_ids_by_name()
        ckpt = self.run.spec.checkpoint
        for node in [n for n in nodes if n in ids]:
            held = self._started.get(node)
            if held is not None and held.node_id == ids[node]:
                continue
            started = self._started[node] = _Started(ids[node], time.monotonic())
            # Found by name when it runs (one ping); a keeper of a node lost under this name is dead, and
            # the committer, finding its handle dead at the launch, takes this one by name.
            if ckpt.in_memory_every:
                started.pings.append(start_keeper(node, ids[node], ckpt.keeper_memory_limit_mb).ping.remote())
                started.what.append("snapshot keeper")
            if self.agents is not None:
                agent, new_agent = current_agent(self.agents, node, ids[node])
                if new_agent:
                    started.pings.append(agent.ping.remote())
                    started.what.append("node agent")

    def ready(self, nodes: list[str]) -> bool:
        """Whether the helpers started ahead on these nodes answered (or died, or the grow, due but for
        them, waited AHEAD_WAIT_S): it may pause now. Never blocks; each node's outcome is said once."""
        now, ok = time.monotonic(), True
        for n in nodes:
            s = self._started.get(n)
            if s is None or s.told or not s.pings:
                continue
            done = ready_now(s.pings)
            waited = now - s.at
            if s.asked is None:
                s.asked = now
            if len(done) < len(s.pings) and now - s.asked < AHEAD_WAIT_S:
                ok = False
                continue
            s.told = True
            what = " and ".join(s.what)
            if len(done) == len(s.pings):
                self.event("helpers_ready", f"The {what} of node {n} answered {waited:.2f}s after they were "
                           "started there ahead of the replica that is to join.", node=n, waited_s=round(waited, 3))
            else:
                self.event("helpers_late", f"The {what} of node {n} did not answer {waited:.2f}s after their start "
                           f"({AHEAD_WAIT_S:.0f}s after the grow onto it was due); the group grows now, and its launch "
                           "waits for them.", node=n,
                           waited_s=round(waited, 3), late=True)
        return ok
