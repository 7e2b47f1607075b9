"""A job's warm spares beside its running group (resources.spares): watched, counted and told.

The watch (service.supervisor.spare_watch) drops spares found dead, stopped or silent; what is left is
counted for the metrics rows and the spares gauge, and told as events: `spares` whenever the set of
ready spares changes, `spare_swapped` when spares take lost replicas' places in a new generation.
"""

from __future__ import annotations

from typing import Any

from service.supervisor.agents import AgentTracker
from service.supervisor.context import JobRun
from service.supervisor.pool import Replica, ReplicaPool, ReplicaState, spares_wanted
from service.supervisor.reporter import Reporter
from service.supervisor.spare_watch import SpareWatch
from service.text import plural
from workers import telemetry


class Spares:
    def __init__(self, run: JobRun, pool: ReplicaPool, reporter: Reporter, agents: AgentTracker | None) -> None:
        self.run = run
        self.pool = pool
        self.reporter = reporter
        self.wanted = spares_wanted(run)  # resources.spares: READY replicas kept beyond the target
        self.now = 0  # spares ready beside the running group, as last counted (see in_row)
        self._told: tuple[int, ...] | None = None  # the spares (replica indices) the last event named
        self.watch = SpareWatch(run, pool, reporter.event, agents)  # dead, hung or silent spares, dropped

    def count_at_launch(self) -> int:
        """The spares beside a generation just launched; the next `tell` names them again against its
        members."""
        self.now = len(self.pool.spares())
        self._told = None
        return self.now

    def tell(self) -> None:
        """An event and the spares gauge whenever the warm spares beside the running group change (a job
        with resources.spares only): how many are ready of how many wanted, and on which nodes."""
        if not self.wanted or not self.pool.count(ReplicaState.ACTIVE):
            return
        self.watch.check()
        spares = self.pool.spares()
        self.now = len(spares)
        now = tuple(r.index for r in spares)
        if now == self._told:
            return
        self._told = now
        members = self.pool.active_nodes()
        nodes = [r.node_name or "?" for r in spares]
        apart = sum(1 for r in spares if r.node_name not in members)
        where = (f" on node {', '.join(nodes)} ({apart} of them away from the group's nodes "
                 f"{', '.join(sorted(members))})" if spares else "")
        short = self.wanted - len(spares)
        self.reporter.event("spares", f"{len(spares)} of {plural(self.wanted, 'warm spare replica')} "
                            f"ready{where}" + (f"; {short} more when capacity allows" if short > 0 else "") + ".",
                            spares=len(spares), wanted=self.wanted, replicas=list(now), nodes=nodes,
                            group_nodes=sorted(members), apart=apart, generation=self.run.generation)
        telemetry.record_group(self.run.job_id, self.run.dp, self.run.generation, spares=len(spares))

    def tell_swap(self, joined: list[Replica], lost: list[int], old_dp: int, dp: int) -> None:
        """The `spare_swapped` event: warm spares that took the place of lost replicas in the generation
        just launched (the job's dp held, or shrank less than it would have without them)."""
        if not joined or not self.wanted:
            return  # without spares, replicas that were ready join as growth (the `resized` event says it)
        nodes = [r.node_name or "?" for r in joined]
        held = "dp stays" if dp >= old_dp else "dp"
        took = f"replaced lost replica(s) {', '.join(str(i) for i in lost)}" if lost else "joined the group"
        self.reporter.event(
            "spare_swapped", f"{plural(len(joined), 'warm spare replica')} ({', '.join(str(r.index) for r in joined)} "
            f"on node {', '.join(nodes)}) {took} in "
            f"generation {self.run.generation}: {held} {dp}" + (f" (was {old_dp})" if dp != old_dp else "") + ".",
            generation=self.run.generation, replicas=[r.index for r in joined], lost=lost, nodes=nodes,
            old_dp=old_dp, dp=dp, spares_left=len(self.pool.spares()))

    def in_row(self, row: dict[str, Any]) -> dict[str, Any]:
        """A copy of a rank's metrics row, which for a job with spares says how many were ready when it
        came (metrics.jsonl and the API's progress carry it). Called by the actor's inbox thread: it reads
        the count the controller's thread last set, never the pool itself."""
        out = dict(row)
        if self.wanted:
            out["spares"] = self.now
        return out
