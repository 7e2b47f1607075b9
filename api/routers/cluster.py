"""GET /v1/cluster: what the cluster holds and does, for the console's cluster page and for scripts.

Nodes with their total and free CPUs/GPUs (Ray's own accounting), the workers each job has
reserved on each node (its placement groups `job-<id>/replica-<k>`), the keeper's snapshot memory
on each node, and the queue in admission order (priority, then submission) with the reason each
job waits (the scheduler's latest `waiting` event). A user sees every node but only its own jobs
(others' queued jobs are counted, not named); an admin sees all. A server without a scheduler
answers with its fixed cluster view and no nodes.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, Field

from api.deps import AppState, current_principal, get_state
from api.routers.jobs import ERRORS
from service.auth import Principal
from service.store import JobRecord

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["cluster"])

KEEPER_TIMEOUT_S = 2.0
_JOB_IN_REASON = re.compile(r"\bjob ([0-9a-f]{6,32})\b")


class Resource(BaseModel):
    total: float
    free: float
    used: float


class KeeperJob(BaseModel):
    bytes: int
    shards: int
    committed: list[list[int]] = Field(description="committed snapshots as [generation, step], oldest first")


class Keeper(BaseModel):
    limit_bytes: int
    used_bytes: int
    jobs: dict[str, KeeperJob] = Field(description="by job id; only jobs visible to the caller")
    other_jobs_bytes: int = Field(0, description="memory held for jobs the caller may not see")
    frames_shared_memory: int = Field(0, description="shards streamed in from its own node's workers "
                                      "through shared memory, since the keeper started")
    frames_kept: int = Field(0, description="of those, shards whose shared-memory segment the keeper kept as "
                             "it was (no copy)")
    frames_socket: int = Field(0, description="shards streamed in over TCP (other nodes' workers, or "
                               "a worker whose segment it could not open)")


class Node(BaseModel):
    node_id: str
    name: str | None = Field(description="the node's unbroken_node_<name> resource, if it has one")
    address: str
    alive: bool
    cpus: Resource
    gpus: Resource
    memory_bytes: float = 0
    workers: dict[str, int] = Field(description="worker slots reserved per visible job id")
    keeper: Keeper | None = Field(None, description="the node's snapshot keeper, if one runs")


class ClusterJob(BaseModel):
    id: str
    name: str
    owner: str
    status: str
    dp: int | None = None
    world_size: int | None = None
    workers_by_node: dict[str, int] = Field(description="node name (or id) -> worker slots reserved")


class QueuedJob(BaseModel):
    position: int = Field(description="1 = admitted next")
    id: str
    name: str
    owner: str
    priority: int
    workers: int = Field(description="the minimum gang")
    submitted_at: float
    reason: str | None = Field(None, description="why it waits (null until the scheduler has looked at it)")


class Cluster(BaseModel):
    ray: bool = Field(description="false: a store-only server (no scheduler, no Ray)")
    dashboard_url: str | None = None
    total: dict[str, float]
    free: dict[str, float]
    nodes: list[Node]
    jobs: list[ClusterJob] = Field(description="admitted, unfinished jobs visible to the caller")
    queue: list[QueuedJob] = Field(description="visible queued jobs, in admission order")
    queue_length: int = Field(description="all queued jobs, the caller's and others'")


def _res(total: dict[str, float], free: dict[str, float], key: str) -> Resource:
    t, f = float(total.get(key, 0.0)), float(free.get(key, 0.0))
    return Resource(total=t, free=f, used=max(0.0, t - f))


def _node_name(resources: dict[str, Any]) -> str | None:
    from checkpointing.keeper import NODE_RESOURCE_PREFIX  # imports ray: only where Ray is read

    for k in resources:
        if k.startswith(NODE_RESOURCE_PREFIX):
            return k[len(NODE_RESOURCE_PREFIX):]
    return None


def _job_of_group(name: str) -> str | None:
    # Placement groups are named job-<id>/replica-<k> (service.placement).
    if name.startswith("job-") and "/" in name:
        return name[len("job-"):name.index("/")]
    return None


def _keeper_reports(names: list[str]) -> dict[str, dict[str, Any]]:
    """{node name: memory_report} of the keepers that answer within KEEPER_TIMEOUT_S."""
    import ray

    from checkpointing.keeper import NAMESPACE, keeper_name

    refs = {}
    for n in names:
        try:
            refs[n] = ray.get_actor(keeper_name(n), namespace=NAMESPACE).memory_report.remote()
        except Exception:  # no keeper on this node (yet): nothing held there
            continue
    if not refs:
        return {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=KEEPER_TIMEOUT_S)
    out = {}
    for n, ref in refs.items():
        if ref in ready:
            try:
                out[n] = ray.get(ref, timeout=0)
            except Exception:
                log.info("keeper-%s did not report its memory", n)
    return out


def _keeper(report: dict[str, Any], visible: set[str] | None) -> Keeper:
    jobs, hidden = {}, 0
    for job_id, e in (report.get("jobs") or {}).items():
        if visible is None or job_id in visible:
            jobs[job_id] = KeeperJob(bytes=int(e.get("bytes", 0)), shards=len(e.get("shards", [])),
                                     committed=[list(map(int, c)) for c in e.get("committed", [])])
        else:
            hidden += int(e.get("bytes", 0))
    frames = report.get("frames") or {}
    return Keeper(limit_bytes=int(report.get("limit_bytes", 0)), used_bytes=int(report.get("used_bytes", 0)),
                  jobs=jobs, other_jobs_bytes=hidden, frames_kept=int(frames.get("kept", 0)),
                  frames_shared_memory=int(frames.get("kept", 0)) + int(frames.get("shared_memory", 0)),
                  frames_socket=int(frames.get("socket", 0)))


def _dashboard_url() -> str | None:
    try:
        import ray._private.worker as ray_worker  # the driver's own record of it; no public accessor

        url = str(ray_worker.get_dashboard_url() or "")
    except Exception:
        return None
    if not url:
        return None
    return url if "://" in url else f"http://{url}"


def _ray_view(visible: set[str] | None) -> tuple[list[Node], dict[str, dict[str, int]], str | None]:
    """(nodes, {job id: {node label: workers}}, dashboard url) from the connected Ray cluster."""
    import ray
    import ray._private.state as ray_state  # per-node free resources: no public API without the dashboard

    free_by_node: dict[str, dict[str, float]] = {}
    try:
        free_by_node = ray_state.available_resources_per_node()
    except Exception:
        log.info("Ray did not report free resources per node")
    from checkpointing.nodes import node_name_of  # imports ray: only where Ray is read

    nodes_raw = ray.nodes()
    label = {n["NodeID"]: node_name_of(n) for n in nodes_raw}  # as the keepers are named
    per_node: dict[str, dict[str, int]] = {}  # node id -> job -> workers
    per_job: dict[str, dict[str, int]] = {}  # job -> node label -> workers
    for info in ray.util.placement_group_table().values():
        job_id = _job_of_group(str(info.get("name", "")))
        if job_id is None or info.get("state") != "CREATED" or (visible is not None and job_id not in visible):
            continue
        for node_id in (info.get("bundles_to_node_id") or {}).values():
            per_node.setdefault(node_id, {})[job_id] = per_node.get(node_id, {}).get(job_id, 0) + 1
            where = label.get(node_id, node_id[:12])
            per_job.setdefault(job_id, {})[where] = per_job.get(job_id, {}).get(where, 0) + 1
    reports = _keeper_reports([label[n["NodeID"]] for n in nodes_raw if n.get("Alive")])
    nodes = []
    for n in sorted(nodes_raw, key=lambda n: (not n.get("Alive"), label[n["NodeID"]])):
        total = n.get("Resources") or {}
        alive = bool(n.get("Alive"))
        free = free_by_node.get(n["NodeID"], {}) if alive else {}
        name = _node_name(total)
        report = reports.get(label[n["NodeID"]]) if alive else None
        nodes.append(Node(
            node_id=n["NodeID"], name=name, address=str(n.get("NodeManagerAddress", "")), alive=alive,
            cpus=_res(total, free, "CPU"), gpus=_res(total, free, "GPU"), memory_bytes=float(total.get("memory", 0)),
            workers=per_node.get(n["NodeID"], {}), keeper=_keeper(report, visible) if report else None,
        ))
    return nodes, per_job, _dashboard_url()


def _wait_reason(state: AppState, job_id: str) -> str | None:
    waits = [e for e in state.store.events(job_id, 0, 1000) if e.kind == "waiting"]
    return waits[-1].message if waits else None


def _redact(reason: str | None, principal: Principal, owners: dict[str, str]) -> str | None:
    """Another user's job named in a reason ("queued behind job <id>") is not revealed to a user."""
    if reason is None or principal.is_admin:
        return reason

    def sub(m: re.Match[str]) -> str:
        return m.group(0) if owners.get(m.group(1)) == principal.name else "another user's job"

    return _JOB_IN_REASON.sub(sub, reason)


@router.get("/cluster", response_model=Cluster, responses={401: ERRORS[401]},
            summary="Nodes, free resources, workers per job, keeper memory, and the queue with reasons")
def cluster(
    principal: Principal = Depends(current_principal),
    state: AppState = Depends(get_state),
    queue_limit: Annotated[int, Query(ge=1, le=1000, description="at most this many queued jobs listed")] = 100,
) -> Cluster:
    def visible_rec(rec: JobRecord) -> bool:
        return principal.can_see(rec.owner)

    admitted = [r for r in state.store.admitted_jobs() if visible_rec(r)]
    queued = state.store.queued_jobs()
    owners = {r.id: r.owner for r in queued} | {r.id: r.owner for r in admitted}
    visible_ids = None if principal.is_admin else {r.id for r in admitted} | {r.id for r in queued if visible_rec(r)}
    nodes: list[Node] = []
    per_job: dict[str, dict[str, int]] = {}
    dashboard = None
    ray_ok = False
    if state.scheduler is not None:
        try:
            nodes, per_job, dashboard = _ray_view(visible_ids)
            ray_ok = True
        except Exception as e:  # Ray down: the store's view still answers
            log.warning("the Ray cluster could not be read: %s", e)
    total: dict[str, float] = {}
    free: dict[str, float] = {}
    if nodes:
        for n in nodes:
            if n.alive:
                for key, r in (("CPU", n.cpus), ("GPU", n.gpus)):
                    total[key] = total.get(key, 0.0) + r.total
                    free[key] = free.get(key, 0.0) + r.free
    else:
        fixed = state.cluster_total or {}
        total = {k: float(v) for k, v in fixed.items() if k in ("CPU", "GPU")}
    jobs = [
        ClusterJob(id=r.id, name=r.name, owner=r.owner, status=r.status, dp=(r.progress or {}).get("dp"),
                   world_size=(r.progress or {}).get("world_size"), workers_by_node=per_job.get(r.id, {}))
        for r in admitted
    ]
    queue = []
    for pos, rec in enumerate(queued, start=1):
        if not visible_rec(rec) or len(queue) >= queue_limit:
            continue
        queue.append(QueuedJob(
            position=pos, id=rec.id, name=rec.name, owner=rec.owner, priority=rec.priority,
            workers=rec.min_world, submitted_at=rec.created_at,
            reason=_redact(_wait_reason(state, rec.id), principal, owners),
        ))
    return Cluster(ray=ray_ok, dashboard_url=dashboard, total=total, free=free, nodes=nodes, jobs=jobs,
                   queue=queue, queue_length=len(queued))
