"""Warm spares that can no longer be swapped in: found and dropped before a failure would pick one.

A spare waits outside the group, so no generation gives its node agent its process to watch and no
collective breaks when it dies. Three signs tell, checked once a heartbeat interval: its node's agent
finds its process stopped (SIGSTOP: hung) or gone (`NodeAgent.process_states`, one call in flight per
node); its worker actor is dead (a ping, one in flight per spare, comes back as Ray's actor error); or
it fell silent (its node lost, or no agent there to ask) for heartbeat_timeout_s. The first two come
about a heartbeat interval after the fact, whatever heartbeat_timeout_s is. Either way the pool drops
it and `fit_pool` asks for another.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from service.supervisor.agents import AgentTracker
from service.supervisor.context import JobRun
from service.supervisor.pool import Replica, ReplicaPool, Slot
from service.supervisor.words import first_line


class SpareWatch:
    def __init__(self, run: JobRun, pool: ReplicaPool, event: Callable[..., None],
                 agents: AgentTracker | None = None) -> None:  # fmt: skip
        self.run = run
        self.pool = pool
        self.event = event
        self.agents = agents  # the job's node agents (their handles by node), None: no agents
        self._checked = 0.0  # monotonic: when the spares were last looked at
        self._pings: dict[str, Any] = {}  # spare worker -> its ping (an `info` call) in flight
        self._states: dict[str, Any] = {}  # node -> its agent's process_states call in flight
        self._seen_states: dict[int, str] = {}  # pid -> the state its agent last answered

    def check(self) -> None:
        """Drop every spare found dead, stopped or silent; at most once a heartbeat interval (the watch
        loop comes every 50 ms)."""
        mono = time.monotonic()
        if mono - self._checked < self.run.ft.heartbeat_interval_s:
            return
        self._checked = mono
        spares = self.pool.spares()
        names = {s.name for r in spares for s in r.slots}
        for gone in self._pings.keys() - names:  # joined the group or dropped: no longer watched here
            del self._pings[gone]
        self._ask_agents(spares)
        now = time.time()
        with self.run.lock:  # only the spares' entries: no copy of every rank's
            seen_at = {n: self.run.hb[n][0] for n in names if n in self.run.hb}
        for rep in spares:
            for s in rep.slots:
                why = self._held(s) or self._died(s) or self._silent(rep, s, seen_at.get(s.name), now, mono)
                if why is not None:
                    text, data = why
                    self.event("spare_lost", f"Spare replica {rep.index} ({s.short} on node "
                               f"{rep.node_name or '?'}) {text}: dropped; another is asked for.",
                               replica=rep.index, worker=s.name, **data)
                    self._pings.pop(s.name, None)
                    if data["how"] != "died":  # a stopped process answers nothing: SIGKILLed where local
                        for x in rep.slots:
                            self.pool.write_off(x, "spare lost")
                    self.pool.drop(rep, "spare lost")
                    break

    def _ask_agents(self, spares: list[Replica]) -> None:
        """Take the node agents' answers that came (pid -> state) and ask again, one call per node
        with spares whose agent runs on that very Ray node."""
        if self.agents is None:
            return
        by_node: dict[str, list[int]] = {}
        for rep in spares:
            if rep.node_name and self.agents.handle_ids.get(rep.node_name) == rep.node:
                by_node.setdefault(rep.node_name, []).extend(
                    int(s.info["pid"]) for s in rep.slots if s.info and s.info.get("pid"))
        for node in list(self._states):
            ref = self._states[node]
            if ray.wait([ref], timeout=0)[0]:
                del self._states[node]
                try:
                    self._seen_states.update(ray.get(ref))
                except Exception:  # noqa: BLE001, S112 - the agent is gone: the others tell
                    continue
        live = {pid for pids in by_node.values() for pid in pids}
        self._seen_states = {p: st for p, st in self._seen_states.items() if p in live}
        for node, pids in by_node.items():
            if pids and node not in self._states:
                self._states[node] = self.agents.handles[node].process_states.remote(pids)

    def _held(self, s: Slot) -> tuple[str, dict[str, Any]] | None:
        """What its node's agent last found of its process: stopped (hung) or gone."""
        state = self._seen_states.get(int((s.info or {}).get("pid") or 0))
        if state == "stopped":
            return "hangs: its process is stopped (seen by its node's agent)", {"how": "stopped"}
        if state == "gone":
            return "died: its process exited (seen by its node's agent)", {"how": "died"}
        return None

    def _died(self, s: Slot) -> tuple[str, dict[str, Any]] | None:
        """Its last ping's answer, if it came: Ray's actor error when the worker is dead; a new ping goes
        out otherwise."""
        ref = self._pings.get(s.name)
        if ref is not None:
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                return None
            try:
                ray.get(ref)
            except RayActorError as e:
                return f"died ({first_line(e)})", {"how": "died"}
            except Exception:  # noqa: BLE001 - an answer, though not the one asked: the actor lives
                pass
        self._pings[s.name] = s.handle.info.remote()
        return None

    def _silent(self, rep: Replica, s: Slot, seen: float | None, now: float,
                mono: float) -> tuple[str, dict[str, Any]] | None:  # fmt: skip
        """Silent for over heartbeat_timeout_s since its last heartbeat, or since it became a spare."""
        waited = mono - rep.since
        silent = waited if seen is None else now - max(seen, now - waited)
        if silent <= self.run.ft.heartbeat_timeout_s:
            return None
        return f"was silent for {silent:.0f}s", {"how": "silent", "silent_s": round(silent, 1)}
