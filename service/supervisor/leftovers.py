"""What a job holds in the cluster beyond its supervisor, found by name and released.

Workers, node agents and placement groups are detached (they outlive a supervisor that crashes, so
its restarted instance can adopt them), and the keepers hold the job's snapshot shards. A supervisor
releases them when its job ends; when it is gone for good (killed, or out of restarts), the
scheduler does it from here, so a failed job's workers do not hold the cluster's CPUs forever.
"""

from __future__ import annotations

import contextlib
import logging

import ray

from checkpointing.naming import agent_prefix, worker_prefix
from service.placement import release_job_groups

log = logging.getLogger(__name__)


def named_actors(prefix: str, namespace: str) -> list[str]:
    """The names of the live named actors of `namespace` that begin with `prefix`."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == namespace and str(a.get("name", "")).startswith(prefix)]


def release_job_actors(job_id: str, namespace: str) -> int:
    """Kill the job's workers and node agents by name and remove its placement groups; how many went.
    Each part is tried whatever the other did (a name listing that fails still leaves the groups to go,
    which takes their workers with them)."""
    gone = 0
    with contextlib.suppress(Exception):
        for name in named_actors(worker_prefix(job_id), namespace) + named_actors(agent_prefix(job_id), namespace):
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
                gone += 1
    with contextlib.suppress(Exception):
        gone += release_job_groups(job_id)
    return gone


def release_leftovers(job_id: str, namespace: str) -> dict[str, int]:
    """After its supervisor is gone for good: the job's actors and placement groups, and its shards on
    every keeper that holds some. {"actors and groups": n, "keeper bytes": n}."""
    from checkpointing.keepers import drop_job, keepers_holding

    out = {"actors and groups": release_job_actors(job_id, namespace), "keeper bytes": 0}
    try:
        holding = keepers_holding(job_id)
        if holding:
            out["keeper bytes"] = int(drop_job(holding, job_id))
    except Exception as e:  # noqa: BLE001 - its actors are released; a keeper's memory waits for the keeper
        log.warning("freeing job %s's snapshot shards on the keepers failed: %s", job_id, e)
    return out
