"""Warm spares that can no longer be swapped in: found and dropped before a failure would pick one.

A spare waits outside the group, so no generation gives its node agent its process to own and no
collective breaks when it dies. Once a heartbeat interval the agent of each node with spares is asked
how their processes are (`NodeAgent.process_states`, one call in flight per node): a process stopped
(SIGSTOP: hung) or gone is found about a heartbeat interval after the fact, whatever
heartbeat_timeout_s is. A spare whose node has no agent of the job's to ask (its start ahead failed),
or whose node is lost, is found by its silence after heartbeat_timeout_s. Either way it is written off
and dropped, and `fit_pool` asks for another.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

from service.supervisor.agents import AgentTracker
from service.supervisor.context import JobRun
from service.supervisor.pool import Replica, ReplicaPool, Slot
from service.supervisor.ray_poll import ready_now
from workers.node_agent import LOST_BY_STATE


class SpareWatch:
    def __init__(self, run: JobRun, pool: ReplicaPool, event: Callable[..., None],
                 agents: AgentTracker | None) -> None:  # fmt: skip
        self.run = run
        self.pool = pool
        self.event = event
        self.agents = agents  # the job's node agents (their handles, by node); None: silence alone tells
        self._checked = 0.0  # monotonic: when the spares were last looked at
        self._asked: dict[str, Any] = {}  # node -> its agent's process_states call in flight
        self._states: dict[int, str] = {}  # spare pid -> the state its agent last answered

    def check(self) -> None:
        """Drop every spare found stopped, gone or silent; at most once a heartbeat interval (the watch
        loop comes every 50 ms)."""
        mono = time.monotonic()
        if mono - self._checked < self.run.ft.heartbeat_interval_s:
            return
        self._checked = mono
        spares = self.pool.spares()
        self._ask_agents(spares)
        now = time.time()
        with self.run.lock:  # only the spares' entries: no copy of every rank's
            seen_at = {s.name: self.run.hb[s.name][0] for r in spares for s in r.slots if s.name in self.run.hb}
        for rep in spares:
            for s in rep.slots:
                why = self._held(s) or self._silent(rep, seen_at.get(s.name), now, mono)
                if why is not None:
                    text, data = why
                    self.event("spare_lost", f"Spare replica {rep.index} ({s.short} on node "
                               f"{rep.node_name or '?'}) {text}: dropped; another is asked for.",
                               replica=rep.index, worker=s.name, **data)
                    for x in rep.slots:  # a stopped process answers no RPC: SIGKILLed where local
                        self.pool.write_off(x, "spare lost")
                    self.pool.drop(rep, "spare lost")
                    break

    def _ask_agents(self, spares: list[Replica]) -> None:
        """Take the answers that came (pid -> state), then ask each node's agent again about its
        spares' processes (where the agent runs on that very Ray node)."""
        if self.agents is None:
            return
        if self._asked:
            done = ready_now(self._asked.values())
            for node in [n for n, ref in self._asked.items() if ref in done]:
                try:
                    self._states.update(ray.get(self._asked.pop(node)))
                except Exception:  # noqa: BLE001, S112 - the agent is gone: its node's loss tells
                    continue
        by_node: dict[str, list[int]] = {}
        for rep in spares:
            if rep.node_name and self.agents.handle_ids.get(rep.node_name) == rep.node:
                by_node.setdefault(rep.node_name, []).extend(s.pid for s in rep.slots if s.pid)
        live = {p for pids in by_node.values() for p in pids}
        self._states = {p: st for p, st in self._states.items() if p in live}
        for node, pids in by_node.items():
            if pids and node not in self._asked:
                self._asked[node] = self.agents.handles[node].process_states.remote(pids)

    def _held(self, s: Slot) -> tuple[str, dict[str, Any]] | None:
        """What its node's agent last found of its process: stopped (hung) or gone (died)."""
        lost = LOST_BY_STATE.get(self._states.get(s.pid or 0, "alive"))
        if lost is None:
            return None
        how, said = lost
        return f"{how}: {said} (seen by its node's agent)", {"how": how}

    def _silent(self, rep: Replica, seen: float | None, now: float, mono: float) -> tuple[str, dict[str, Any]] | None:
        """Silent for over heartbeat_timeout_s since its last heartbeat, or since it became a spare."""
        waited = mono - rep.since
        silent = waited if seen is None else now - max(seen, now - waited)
        if silent <= self.run.ft.heartbeat_timeout_s:
            return None
        return f"was silent for {silent:.0f}s", {"how": "silent", "silent_s": round(silent, 1)}
