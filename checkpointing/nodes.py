"""Node identity from Ray's view of the cluster: a node's name (ours where we named it, else its id's
first 12 hex digits), the alive nodes by name, and which one is the head."""

from __future__ import annotations

from typing import Any

import ray

from checkpointing.naming import NODE_RESOURCE_PREFIX


def node_name_of(node: dict[str, Any]) -> str:
    """A node's name, from what Ray reports of it (an entry of `ray.nodes()`).

    A node started with the resource `unbroken_node_<name>` (our local clusters give simulated nodes
    readable names that way) is called <name>; any other node is called by the first 12 hex digits of
    its Ray node id, unique and stable for the node's life. Nothing needs to be configured.
    """
    for key in node.get("Resources", {}):
        if key.startswith(NODE_RESOURCE_PREFIX):
            return str(key[len(NODE_RESOURCE_PREFIX) :])
    return str(node["NodeID"])[:12]


def node_ids_by_name() -> dict[str, str]:
    """{node name: Ray node id} of the alive nodes."""
    return {node_name_of(n): str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}


def is_head(node: dict[str, Any]) -> bool:
    """Whether a `ray.nodes()` entry is the cluster's head node (Ray marks it with a resource)."""
    return any(k.startswith("node:__internal_head__") for k in node.get("Resources", {}))


def current_node_name() -> str:
    """The name (see node_name_of) of the node this process runs on (inside a Ray task or actor)."""
    node_id = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return node_name_of(n)
    return str(node_id)[:12]


def current_node_is_head() -> bool:
    """Whether this process runs on the head node (inside a Ray task or actor)."""
    node_id = ray.get_runtime_context().get_node_id()
    return any(is_head(n) for n in ray.nodes() if n["NodeID"] == node_id)
