"""A LocalCluster's head serves its dashboard agent on a port of its own.

Ray's default for the head's agent is a fixed port (52365). Where another cluster on the machine (a
test file beside this one, a user's second job) holds it, the agent serves nothing and never records
its address, and Ray's log API then fails for every actor on the head with "Agent for node id ...
doesn't exist". This test holds that port itself, so the clash is certain, not a matter of timing.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest
from ray._private import ray_constants
from ray._raylet import GcsClient
from ray.dashboard import consts as dashboard_consts

from service.local_cluster import LocalCluster


def agent_address(gcs: GcsClient, node_id: str, timeout_s: float) -> list[object] | None:
    """(ip, http_port, grpc_port) the node's dashboard agent recorded in the GCS, or None by the deadline."""
    key = f"{dashboard_consts.DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX}{node_id}".encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = gcs.internal_kv_get(key, namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
        if got:
            return list(json.loads(got))
        time.sleep(0.5)
    return None


@pytest.mark.slow
def test_head_agent_registers_while_the_default_agent_port_is_taken() -> None:
    held = socket.socket()
    with contextlib.suppress(OSError):  # already held by someone else: taken either way
        held.bind(("127.0.0.1", ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT))
        held.listen()
    cluster = LocalCluster(head_cpus=1, dashboard=True)
    try:
        cluster.start()
        got = agent_address(GcsClient(address=cluster.address), cluster.node_id("head"), timeout_s=60)
        assert got is not None, "the head's dashboard agent never recorded its address"
        assert got[1] not in (-1, ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT), got
    finally:
        cluster.shutdown()
        held.close()
