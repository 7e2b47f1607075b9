"""The job's snapshot keepers: one on every node the job uses, started before each generation.

Between re-forms the keepers are pinged every KEEPER_WATCH_S: one killed while its node lives is started
again at once (the ranks find it by name), so no snapshot stays held once for long. The commit of what
they hold is service.supervisor.committer's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from service.supervisor.context import JobFailed, JobRun
from service.supervisor.ray_poll import ready_now
from service.supervisor.reporter import Reporter

log = logging.getLogger("unbroken.supervisor")

KEEPER_WATCH_S = 1.0  # how often the watch loop pings the keepers between re-forms
_KEEPER_START_S = 10.0  # a keeper started again that does not answer by then is given up (its node is going)


class KeeperSet:
    def __init__(self, run: JobRun, reporter: Reporter) -> None:
        self.run = run
        self.reporter = reporter
        self.handles: dict[str, Any] = {}  # node name -> its keeper
        self._pings: dict[str, Any] = {}  # node -> a keeper ping in flight (watch)
        self._pinged_at = 0.0
        self._restarting: dict[str, Any] = {}  # node -> keeper handle started again, once it answered
        self._restart_threads: dict[str, threading.Thread] = {}

    def ensure(self, slots: list[Any]) -> None:
        """A keeper on every node the job uses (kept for nodes it used before, while they live).

        Nodes are named from Ray itself (checkpointing.nodes.node_name_of), so this works on any
        cluster. One node means one copy of each shard: said once, as a warning event."""
        spec = self.run.spec
        if not spec.checkpoint.in_memory_every:
            return
        from checkpointing.keepers import KeepersNotStarted, ensure_keepers
        from checkpointing.nodes import node_ids_by_name

        alive = node_ids_by_name()
        nodes = {str(s.info["node_name"]) for s in slots if s.info and s.info.get("node_name")}
        # A node the generation left (lost, most often): no rank tries to restore from its keeper first.
        for name in _nodes_gone([n for n in self.handles if n not in nodes], alive):
            self.handles.pop(name)  # its node is gone, and its memory with it
            alive.pop(name, None)
        self._replace_dead(alive)
        missing = sorted(nodes - set(self.handles))
        if missing:
            try:
                self.handles.update(ensure_keepers(missing, memory_limit_mb=spec.checkpoint.keeper_memory_limit_mb))
            except (TimeoutError, ValueError) as e:
                if isinstance(e, KeepersNotStarted):
                    self.handles.update(e.started)
                    missing = sorted(set(missing) - set(e.started))
                self.reporter.event("keepers_missing", f"in-memory snapshots: no keeper on node(s) "
                                    f"{', '.join(missing)} ({e}); their ranks' snapshots go to the other nodes' "
                                    "keepers", nodes=missing)
        if not self.handles:
            raise JobFailed("checkpoint.in_memory_every is set but no node could hold an in-memory snapshot "
                            "(no keeper could be started); set checkpoint.in_memory_every: 0 or check the cluster")
        if len(self.handles) < 2 and "one_copy" not in self.reporter.warnings:
            self.reporter.warnings.append("one_copy")
            only = next(iter(self.handles))
            self.reporter.event("warning", f"In-memory snapshots are kept on one node only ({only}): a worker "
                                "failure recovers from memory, but the loss of that node falls back to the last "
                                "persistent checkpoint. Add a second node to keep a second copy.",
                                node=only, copies=1)

    def _replace_dead(self, alive_nodes: dict[str, str]) -> None:
        """A keeper that died while its node lives (killed, out of memory) is dropped, said, and started
        again below; its snapshots are gone, the other copies hold them."""
        if not self.handles:
            return
        from checkpointing.keepers import alive_keepers

        answering = alive_keepers(self.handles, timeout_s=5.0)
        for name in sorted(set(self.handles) - set(answering)):
            self.handles.pop(name)
            if name in alive_nodes:
                self._tell_lost(name)

    def _tell_lost(self, name: str) -> None:
        self.reporter.event("keeper_lost", f"The snapshot keeper on node {name} is gone while its node lives; a "
                            "new one starts there, and the other keepers' copies serve restores meanwhile.",
                            node=name)

    def watch(self) -> None:
        """Called by the watch loop (never blocks): a keeper found dead is dropped and, where its node lives,
        started again on a thread; it joins the keepers once it answers. Until then the ranks send that
        node's copies to the next keeper in the ring (checkpointing.snapshot_send)."""
        if not self.run.spec.checkpoint.in_memory_every:
            return
        import ray
        from ray.exceptions import RayActorError

        for name in [n for n, t in self._restart_threads.items() if not t.is_alive()]:
            self._restart_threads.pop(name)
            fresh = self._restarting.pop(name, None)
            if fresh is not None:
                self.handles[name] = fresh
        if self._pings:
            done = ready_now(self._pings.values())
            if len(done) < len(self._pings) and time.monotonic() - self._pinged_at < _KEEPER_START_S:
                return  # a slow keeper is not a dead one
            dead = []
            for name, ref in self._pings.items():
                try:
                    ray.get(ref, timeout=0)
                except RayActorError:
                    dead.append(name)
                except Exception:  # noqa: BLE001 - late or busy: asked again next time
                    pass
            self._pings = {}
            for name in dead:
                self._restart(name)
        if self.handles and time.monotonic() - self._pinged_at >= KEEPER_WATCH_S:
            self._pinged_at = time.monotonic()
            self._pings = {n: h.ping.remote() for n, h in self.handles.items()}

    def _restart(self, name: str) -> None:
        from checkpointing.nodes import node_ids_by_name

        self.handles.pop(name, None)
        if name in self._restart_threads or _nodes_gone([name], node_ids_by_name()):
            return  # its node is gone too: the failure detector handles that
        self._tell_lost(name)
        limit = self.run.spec.checkpoint.keeper_memory_limit_mb

        def start() -> None:
            from checkpointing.keepers import ensure_keepers

            try:
                self._restarting.update(ensure_keepers([name], memory_limit_mb=limit, timeout_s=_KEEPER_START_S))
            except Exception as e:  # noqa: BLE001 - its node is going: the next re-form sees to it
                log.warning("starting the keeper on %s again failed: %s", name, e)

        t = self._restart_threads[name] = threading.Thread(target=start, name=f"keeper-{name}", daemon=True)
        t.start()


def _nodes_gone(names: list[str], alive: dict[str, str]) -> set[str]:
    """Those of the node names `names` that are gone: out of Ray's table (`alive`, name -> id), or still in
    it for a second or two after their loss while their raylet refuses connections."""
    from checkpointing.nodes import dead_node_names

    gone = {n for n in names if n not in alive}
    with contextlib.suppress(Exception):  # the GCS busy: the table's word alone
        gone |= dead_node_names(sorted(n for n in names if n in alive))
    return gone
