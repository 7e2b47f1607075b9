"""Where in-memory snapshot copies go, at any number of nodes: a ring over the nodes.

Every rank sends its shard to its own node's keeper and to the next node's in sorted order
(checkpointing.snapshot_send.replica_nodes applies `ring`), so each keeper holds its own node's
shards and the previous node's: the same load on every keeper when nodes hold the same ranks, no
keeper holding more than two nodes' worth (no hot keeper, whatever the cluster's size), and a lost
node's shards are still on the next one. A commit asks each keeper only which ranks of that snapshot
it holds (Keeper.held): O(nodes) calls, O(ranks per node) each.

A keeper's memory is bounded by its limit (Keeper refuses what does not fit); `keeper_peak_bytes`
says what the ring needs of it, so the limit can be checked before a job starts, and
`ring_memory` reports each keeper's use beside that need.
Plain functions (ring_memory asks the keepers through Ray).
"""

from __future__ import annotations

from typing import Any

from checkpointing.keeper import KEEP_COMMITTED


def ring(nodes: list[str]) -> dict[str, list[str]]:
    """node -> the keepers its ranks send to: its own, then the next node's in sorted order (one node:
    its own only)."""
    ordered = sorted(set(nodes))
    if len(ordered) < 2:
        return {n: [n] for n in ordered}
    return {n: [n, ordered[(i + 1) % len(ordered)]] for i, n in enumerate(ordered)}


def ring_load(per_node: dict[str, int]) -> dict[str, int]:
    """How much each keeper holds of one snapshot, given each node's share (ranks, or bytes): its own
    node's plus every node's that sends it a copy."""
    load = dict.fromkeys(per_node, 0)
    for node, targets in ring(list(per_node)).items():
        for t in targets:
            load[t] += per_node[node]
    return load


def imbalance(load: dict[str, int]) -> float:
    """The most loaded keeper over the mean (1.0: perfectly balanced)."""
    if not load:
        return 1.0
    mean = sum(load.values()) / len(load)
    return max(load.values()) / mean if mean else 1.0


def keeper_peak_bytes(bytes_per_node: dict[str, int], in_flight: int = 1) -> dict[str, int]:
    """The most a keeper holds for one job: its ring share of a snapshot, times the committed ones it
    keeps (KEEP_COMMITTED) plus those in flight (sent, not yet committed)."""
    return {n: b * (KEEP_COMMITTED + in_flight) for n, b in ring_load(bytes_per_node).items()}


def ring_memory(keepers: dict[str, Any], bytes_per_node: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Each live keeper's memory: {node: {"used_bytes", "limit_bytes", "need_bytes" (the ring's peak, when
    bytes_per_node is given), "fits"}}."""
    from checkpointing.keepers import memory_reports

    need = keeper_peak_bytes(bytes_per_node) if bytes_per_node else {}
    out: dict[str, dict[str, Any]] = {}
    for node, rep in memory_reports(keepers).items():
        n = need.get(node)
        out[node] = {"used_bytes": rep["used_bytes"], "limit_bytes": rep["limit_bytes"], "need_bytes": n,
                     "fits": None if n is None else n <= rep["limit_bytes"]}
    return out
