"""The keepers' ring (checkpointing.ring): balanced at any size, the senders' targets, per-snapshot
commit answers, and a keeper's memory within the ring's bound while snapshots come and go."""

from __future__ import annotations

import numpy as np

from checkpointing.keeper import Keeper
from checkpointing.ring import imbalance, keeper_peak_bytes, ring, ring_load
from checkpointing.snapshot_send import replica_nodes


def test_the_ring_is_what_the_ranks_send_to_and_is_balanced_at_1250_nodes() -> None:
    nodes = [f"n{i:04d}" for i in range(1250)]
    targets = ring(nodes)
    for n in nodes[:50] + nodes[-5:]:
        assert targets[n] == replica_nodes(n, nodes)
    assert targets[nodes[-1]] == [nodes[-1], nodes[0]]  # it closes
    load = ring_load(dict.fromkeys(nodes, 8))
    assert set(load.values()) == {16} and imbalance(load) == 1.0  # every keeper: its node's 8 and one more node's
    assert ring(["only"]) == {"only": ["only"]} and ring_load({"only": 8}) == {"only": 8}
    uneven = ring_load({"a": 8, "b": 2, "c": 8})
    assert uneven == {"a": 16, "b": 10, "c": 10} and max(uneven.values()) <= 2 * 8


def test_a_keeper_answers_a_commit_with_its_ring_share_and_stays_within_the_ring_bound() -> None:
    nodes = ["a", "b", "c"]
    per_node = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    keepers = {n: Keeper(n, memory_limit_mb=4) for n in nodes}
    shard = 64 * 1024
    need = keeper_peak_bytes({n: shard * len(r) for n, r in per_node.items()})
    peak = dict.fromkeys(nodes, 0)
    for step in range(1, 11):
        for node, ranks in per_node.items():
            for r in ranks:
                for target in ring(nodes)[node]:
                    keepers[target].put_shard("job", 0, step, r, 6, b"", b"", np.zeros(shard, dtype=np.uint8))
        for n, k in keepers.items():
            peak[n] = max(peak[n], k.used)
        # Each keeper holds its own node's ranks and the previous node's: what the committer counts.
        assert keepers["b"].held("job", 0, step) == [0, 1, 2, 3]
        assert keepers["a"].held("job", 0, step) == [0, 1, 4, 5]
        copies = [r for k in keepers.values() for r in k.held("job", 0, step)]
        assert sorted(copies) == sorted(2 * [0, 1, 2, 3, 4, 5])
        for k in keepers.values():
            k.commit("job", 0, step)
    for n, k in keepers.items():
        rep = k.memory_report()
        assert rep["used_bytes"] == k.used <= need[n] and peak[n] <= need[n], (n, rep, need)
        assert rep["jobs"]["job"]["committed"] == [(0, 9), (0, 10)]
    assert keepers["a"].held("job", 0, 3) == []  # freed by retention
