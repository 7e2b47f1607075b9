"""Warm spares that can no longer be swapped in: found and dropped before a failure would pick one.

A spare waits outside the group, so no node agent watches its process and no collective breaks when it
dies. Two signs tell: its worker actor is dead (a ping, one in flight per spare, comes back as Ray's
actor error: about a heartbeat interval after the death, whatever heartbeat_timeout_s is), or it fell
silent (hung, or its node lost) for heartbeat_timeout_s. Either way the pool drops it and `fit_pool`
asks for another.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from service.supervisor.context import JobRun
from service.supervisor.pool import Replica, ReplicaPool, Slot
from service.supervisor.words import first_line


class SpareWatch:
    def __init__(self, run: JobRun, pool: ReplicaPool, event: Callable[..., None]) -> None:
        self.run = run
        self.pool = pool
        self.event = event
        self._checked = 0.0  # monotonic: when the spares were last looked at
        self._pings: dict[str, Any] = {}  # spare worker -> its ping (an `info` call) in flight

    def check(self) -> None:
        """Drop every spare found dead or silent; at most once a heartbeat interval (the watch loop
        comes every 50 ms)."""
        mono = time.monotonic()
        if mono - self._checked < self.run.ft.heartbeat_interval_s:
            return
        self._checked = mono
        spares = self.pool.spares()
        names = {s.name for r in spares for s in r.slots}
        for gone in self._pings.keys() - names:  # joined the group or dropped: no longer watched here
            del self._pings[gone]
        now = time.time()
        with self.run.lock:  # only the spares' entries: no copy of every rank's
            seen_at = {n: self.run.hb[n][0] for n in names if n in self.run.hb}
        for rep in spares:
            for s in rep.slots:
                why = self._died(s) or self._silent(rep, s, seen_at.get(s.name), now, mono)
                if why is not None:
                    text, data = why
                    self.event("spare_lost", f"Spare replica {rep.index} ({s.short} on node "
                               f"{rep.node_name or '?'}) {text}: dropped; another is asked for.",
                               replica=rep.index, worker=s.name, **data)
                    self._pings.pop(s.name, None)
                    self.pool.drop(rep, "spare lost")
                    break

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
