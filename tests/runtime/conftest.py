"""One private multi-node Ray cluster per test module (fast failure detection), always shut down."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.local_cluster import LocalCluster
from workers.ports import free_port


def make_cluster(head_cpus: float, nodes: dict[str, float], *, observed: bool = False) -> Iterator[LocalCluster]:
    """observed: with the dashboard and the node's Prometheus endpoint (on a free port)."""
    cluster = LocalCluster(head_cpus=head_cpus, dashboard=observed,
                           metrics_export_port=free_port() if observed else None)
    try:
        cluster.start()
        for name, cpus in nodes.items():
            cluster.add_node(name, num_cpus=cpus)
        cluster.connect()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def head_cluster() -> Iterator[LocalCluster]:
    """One node with room for exactly four 0.5-CPU workers."""
    yield from make_cluster(2, {})


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[LocalCluster]:
    """Head and node b, each with room for two 0.5-CPU workers."""
    yield from make_cluster(1, {"b": 1})
