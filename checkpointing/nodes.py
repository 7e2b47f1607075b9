"""Node identity from Ray's view of the cluster: a node's name (ours where we named it, else its id's
first 12 hex digits), the alive nodes by name, which one is the head, and which nodes are gone."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
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


RAYLET_PROBE_S = 0.25  # a connect to a raylet's port: refused at once when its process is gone


def dead_node_ids(ids: Iterable[str]) -> set[str]:
    """Those of the Ray node ids `ids` whose node is gone: Ray's node table says so (about 1.4 s after
    the node, NOTES.md), or its raylet's port refuses a connection (its process is gone: at once). A
    node that does not answer within RAYLET_PROBE_S is not judged here (a partition: Ray's table will)."""
    want = set(ids)
    if not want:
        return set()
    table = {str(n["NodeID"]): n for n in ray.nodes()}
    return {node_id for node_id in want if (n := table.get(node_id)) is None or _gone(n)}


def dead_node_names(names: Sequence[str], probe: int = 64) -> set[str]:
    """Those of the node names `names` (the most suspect first) whose every Ray node of that name is gone,
    as in dead_node_ids; the raylets of only the first `probe` are asked (a large cluster's recovery
    does not wait on a thousand connects). A name Ray does not know is not judged."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for n in ray.nodes():
        by_name.setdefault(node_name_of(n), []).append(n)
    dead = set()
    for i, name in enumerate(names):
        entries = by_name.get(name)
        if entries and all(not n.get("Alive") or (i < probe and _gone(n)) for n in entries):
            dead.add(name)
    return dead


def _gone(n: dict[str, Any]) -> bool:
    return not n.get("Alive") or _refuses(str(n.get("NodeManagerAddress") or ""), int(n.get("NodeManagerPort") or 0))


def _refuses(host: str, port: int) -> bool:
    if not host or not port:
        return False
    try:
        with socket.create_connection((host, port), timeout=RAYLET_PROBE_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a timeout, no route: not proof of anything
        return False
