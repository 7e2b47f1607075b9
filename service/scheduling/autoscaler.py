"""Queued demand for Ray's autoscaler (`ray.autoscaler.sdk.request_resources`, which KubeRay's autoscaler
honours): the shape the cluster should have for every admitted job plus every job that waits for
capacity, asked again only when it changes, and released (an empty request) once nothing waits.

request_resources is a target shape, not an increment (Ray: "takes into account existing resource
usage"), so the admitted jobs' replicas are in the request too; without them the autoscaler would count
the queued job's bundles as already met by the nodes the running jobs occupy.
"""

from __future__ import annotations

import logging

from service.scheduling.policies import Plan
from service.scheduling.snapshot import Snapshot

log = logging.getLogger(__name__)

Bundles = list[dict[str, float]]


def _worker_bundles(replica: dict[str, float], workers_per_replica: int, replicas: int) -> Bundles:
    per_worker = {k: v / workers_per_replica for k, v in replica.items() if v > 0}
    return [dict(per_worker) for _ in range(replicas * workers_per_replica)] if per_worker else []


def queued_demand(snap: Snapshot, plan: Plan) -> Bundles:
    """One bundle per worker: admitted jobs at what they hold, and the minimum gang of each queued job
    that waits for capacity (not for its owner's quota). [] (released) once no job waits for capacity and
    every admitted job runs: a job admitted onto a new node holds the request until its workers are
    placed there, or the autoscaler could take the node back as idle in between."""
    waiting = [j for j in snap.queued if j.id not in plan.admit and "quota" not in plan.waiting.get(j.id, "")]
    starting = [j for j in snap.running if j.dp == 0] or [j for j in snap.queued if j.id in plan.admit]
    if not waiting and not starting:
        return []
    out: Bundles = []
    for j in snap.running:
        out += _worker_bundles(j.replica, j.workers_per_replica, j.held)
    for j in snap.queued:
        if j.id in plan.admit:
            out += _worker_bundles(j.replica, j.workers_per_replica, plan.admit[j.id] + j.spares)
    for j in waiting:
        out += _worker_bundles(j.replica, j.workers_per_replica, j.gang)
    return out


class DemandRequest:
    """The standing request to Ray's autoscaler; `update` sends it when it changed."""

    def __init__(self) -> None:
        self.bundles: Bundles = []
        self.requests = 0  # how many requests were sent (a changed shape or a release)

    def update(self, bundles: Bundles) -> None:
        if bundles == self.bundles:
            return
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)
        except Exception as e:  # noqa: BLE001 - no autoscaler (or no Ray) only means no scale-up
            log.warning("could not ask Ray's autoscaler for %d bundle(s): %s", len(bundles), e)
            return
        log.info("asked Ray's autoscaler for %d worker bundle(s)%s", len(bundles), "" if bundles else " (released)")
        self.bundles = bundles
        self.requests += 1
