"""Where a job's workers run: one placement group per data-parallel replica.

A replica is the tp x pp x cp workers of one model-parallel group; its bundles are STRICT_PACK,
so they land on one node (their collectives are the chattiest), and losing a node loses whole
replicas. Groups are detached (they outlive a restarting supervisor) and named
`job-<id>/replica-<k>`, so a restarted supervisor or a leak check finds them by name.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def replica_pg_name(job_id: str, index: int) -> str:
    return f"job-{job_id}/replica-{index}"


@dataclass
class ReplicaReservation:
    index: int
    pg: PlacementGroup
    ready_ref: Any

    def ready(self, timeout_s: float = 0.0) -> bool:
        done, _ = ray.wait([self.ready_ref], timeout=timeout_s)
        return bool(done)

    def strategy(self, bundle: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=False,
        )


def reserve_replica(job_id: str, index: int, mp: int, per_worker: dict[str, float],
                    prefer_node: str | None = None) -> ReplicaReservation:
    """Ask for one replica's bundles (mp x per_worker, one node); check `.ready()` for the grant.
    `prefer_node`: a Ray node id to place it on if that node has room (a soft hint: a hot spare away
    from the group's nodes)."""
    bundle = {k: float(v) for k, v in per_worker.items() if v} or {"CPU": 0.001}
    pg = placement_group([dict(bundle) for _ in range(mp)], strategy="STRICT_PACK",
                         name=replica_pg_name(job_id, index), lifetime="detached",
                         _soft_target_node_id=prefer_node)
    return ReplicaReservation(index, pg, pg.ready())


def release(res: ReplicaReservation | PlacementGroup) -> None:
    pg = res.pg if isinstance(res, ReplicaReservation) else res
    with contextlib.suppress(Exception):
        remove_placement_group(pg)


def job_placement_groups(job_id: str) -> list[dict[str, Any]]:
    """Live (not removed) placement groups of a job, from Ray's table."""
    prefix = f"job-{job_id}/"
    out = []
    for pg_id, info in ray.util.placement_group_table().items():
        if str(info.get("name", "")).startswith(prefix) and info.get("state") != "REMOVED":
            out.append({"id": pg_id, **info})
    return out


def release_job_groups(job_id: str) -> int:
    """Remove every live placement group of a job (after a supervisor restart, or at the end)."""
    n = 0
    for info in job_placement_groups(job_id):
        with contextlib.suppress(Exception):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(info["id"]))))
            n += 1
    return n
