"""Every name Unbroken gives a thing in Ray, in one place: the namespace, actor names, node resources.

It sits in checkpointing, the lowest package that uses Ray names (its keepers are `keeper-<node>`),
so the keepers, the workers and the service all import it from here and none of them defines a copy.
Plain strings only: no ray, no torch.
"""

from __future__ import annotations

NAMESPACE = "unbroken"  # every detached actor of the service lives in this Ray namespace

# Node resources: readable names for simulated nodes (service.local_cluster; see
# checkpointing.nodes.node_name_of), and the marker of nodes meant for the control path, where
# supervisors run.
NODE_RESOURCE_PREFIX = "unbroken_node_"
CONTROL_RESOURCE = "unbroken_control"


def keeper_name(node: str) -> str:
    """The keeper actor of a node."""
    return f"keeper-{node}"


def supervisor_name(job_id: str) -> str:
    """The supervisor actor of a job."""
    return f"job-{job_id}/supervisor"


def agent_prefix(job_id: str) -> str:
    """What every node agent name of a job starts with."""
    return f"job-{job_id}/agent-"


def agent_name(job_id: str, node: str) -> str:
    """The node agent of a job on a node (workers.node_agent)."""
    return f"{agent_prefix(job_id)}{node}"


def worker_prefix(job_id: str) -> str:
    """What every worker actor name of a job starts with (to find them after a supervisor restart)."""
    return f"job-{job_id}/worker-"


def worker_name(job_id: str, n: int) -> str:
    """The job's n-th worker actor (n counts every worker the job ever started)."""
    return f"{worker_prefix(job_id)}{n}"


def worker_number(name: str) -> int:
    """n of a worker_name."""
    return int(name.rsplit("-", 1)[1])
