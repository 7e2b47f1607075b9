"""workers/telemetry.py end to end: values recorded inside a Ray actor appear on the node's
Prometheus endpoint with the job_id/rank/cause labels, and the named actor is listed by the
dashboard's state REST API. One private cluster (LocalCluster, dashboard on) for the module."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from service.local_cluster import LocalCluster
from tests.runtime.conftest import make_cluster
from workers import telemetry

JOB = "teltest1"
ACTOR = f"job-{JOB}/worker-0"
DEADLINE_S = 90.0  # Ray exports ~10 s after recording; a busy 2-core machine can be slower


@dataclass
class Step:
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    mfu: float | None
    eval_loss: float | None = None


@ray.remote(num_cpus=0)
class Reporter:
    """Stands where a worker and a supervisor stand: records through workers.telemetry."""

    def report(self) -> bool:
        from checkpointing.keeper import Keeper
        from workers import telemetry as t

        t.record_step(JOB, 0, Step(step=7, loss=2.5, step_time_s=0.1, tokens_per_s=1234.0, mfu=0.42, eval_loss=2.7))
        t.record_step(JOB, 1, Step(step=7, loss=2.5, step_time_s=0.2, tokens_per_s=1234.0, mfu=None))
        t.record_group(JOB, dp=3, generation=4)
        t.record_snapshot(JOB, 0, 0.05, 1_000_000)
        t.record_checkpoint(JOB, 0, 3.0, 5_000_000)
        t.record_recovery(JOB, "node_lost")
        t.record_recovery(JOB, "node_lost")
        t.record_recovery(JOB, "actor_died")
        t.record_pause(JOB, "growth", 0.4)
        t.record_pause(JOB, "growth", 0.6)
        t.record_heartbeat_age(JOB, 1, 0.75)
        t.record_store_writes(JOB, 3, 1)
        # A keeper exports its own memory: one held here, in this process, holding 123,456 bytes.
        keeper = Keeper("teltestnode", memory_limit_mb=1)
        keeper.put_shard("teltest", 0, 1, 0, 1, b"", b"", np.zeros(123_456, dtype=np.uint8))
        return True


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from make_cluster(1, {}, observed=True)


@pytest.fixture(scope="module")
def reporter(cluster: LocalCluster) -> ray.actor.ActorHandle:
    """The named actor, alive for the whole module, after it has recorded everything once."""
    handle = Reporter.options(name=ACTOR, namespace="unbroken").remote()
    assert ray.get(handle.report.remote(), timeout=60)
    return handle


def _samples(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k in ("job_id", "rank", "cause", "node", "le"))
            out[(s.name, labels)] = s.value
    return out


def _key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return (name, frozenset(labels.items()))


def test_without_ray_record_functions_do_nothing() -> None:
    if ray.is_initialized():
        pytest.skip("this process is connected to Ray already")
    telemetry.record_step(JOB, 0, Step(1, 1.0, 0.1, 1.0, None))
    telemetry.record_group(JOB, dp=1, generation=0)
    telemetry.record_recovery(JOB, "x")
    assert telemetry._metrics is None  # nothing was created: the local launcher pays nothing


def test_metrics_reach_prometheus_endpoint(cluster: LocalCluster, reporter: ray.actor.ActorHandle) -> None:
    p = "ray_"
    want = {
        _key(p + "unbroken_loss", job_id=JOB, rank="0"): 2.5,
        _key(p + "unbroken_eval_loss", job_id=JOB, rank="0"): 2.7,
        _key(p + "unbroken_tokens_per_s", job_id=JOB, rank="1"): 1234.0,
        _key(p + "unbroken_mfu", job_id=JOB, rank="0"): 0.42,
        _key(p + "unbroken_step", job_id=JOB, rank="0"): 7.0,
        _key(p + "unbroken_dp_degree", job_id=JOB): 3.0,
        _key(p + "unbroken_generation", job_id=JOB): 4.0,
        _key(p + "unbroken_step_time_s", job_id=JOB, rank="1"): 0.2,
        _key(p + "unbroken_snapshot_bytes", job_id=JOB, rank="0"): 1_000_000.0,
        _key(p + "unbroken_snapshot_seconds_count", job_id=JOB, rank="0"): 1.0,
        _key(p + "unbroken_checkpoint_bytes", job_id=JOB, rank="0"): 5_000_000.0,
        _key(p + "unbroken_checkpoint_seconds_count", job_id=JOB, rank="0"): 1.0,
        _key(p + "unbroken_recoveries_total", job_id=JOB, cause="node_lost"): 2.0,
        _key(p + "unbroken_recoveries_total", job_id=JOB, cause="actor_died"): 1.0,
        _key(p + "unbroken_pause_seconds_count", job_id=JOB, cause="growth"): 2.0,
        _key(p + "unbroken_pause_seconds_bucket", job_id=JOB, cause="growth", le="0.5"): 1.0,
        _key(p + "unbroken_heartbeat_age_s", job_id=JOB, rank="1"): 0.75,
        _key(p + "unbroken_store_backlog", job_id=JOB): 3.0,
        _key(p + "unbroken_store_write_failures", job_id=JOB): 1.0,
        _key(p + "unbroken_keeper_memory_bytes", node="teltestnode"): 123_456.0,
    }
    assert cluster.metrics_export_port is not None
    deadline = time.monotonic() + DEADLINE_S
    got: dict = {}
    while time.monotonic() < deadline:
        got = _samples(cluster.metrics_export_port)
        if all(k in got for k in want):
            break
        time.sleep(1.0)
    missing = [k for k in want if k not in got]
    assert not missing, f"not exported within {DEADLINE_S} s: {missing}"
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    # rank 1 had no MFU (CPU): no series rather than a made-up 0
    assert _key(p + "unbroken_mfu", job_id=JOB, rank="1") not in got
    # Histograms: 3.0 s lands in the (2.5, 5] bucket; Ray's _sum is approximate (from buckets).
    ck = p + "unbroken_checkpoint_seconds_bucket"
    assert got[_key(ck, job_id=JOB, rank="0", le="2.5")] == 0.0
    assert got[_key(ck, job_id=JOB, rank="0", le="5.0")] == 1.0
    assert 2.5 < got[_key(p + "unbroken_checkpoint_seconds_sum", job_id=JOB, rank="0")] <= 5.0
    # Every name telemetry declares as exported is what Prometheus shows (the dashboard relies on it).
    seen = {name for name, _ in got}
    assert telemetry.exported_names() <= seen, telemetry.exported_names() - seen


# The dashboard needs Ray's token once Ray has turned token auth on (it does for any cluster started
# after ~/.ray/auth_token exists, i.e. after an earlier test's `ray.init`): without the header every
# request is a 401, which is why this check once failed only in the full suite.
def test_named_actor_is_listed_by_dashboard(cluster: LocalCluster, reporter: ray.actor.ActorHandle) -> None:
    assert ray.get_actor(ACTOR, namespace="unbroken")._actor_id == reporter._actor_id
    assert cluster.dashboard_url is not None
    version = httpx.get(f"{cluster.dashboard_url}/api/version", headers=cluster.dashboard_headers(), timeout=30).json()
    assert version["session_name"] == ray._private.worker.global_worker.node.session_name, version
    q = urllib.parse.urlencode({"filter_keys": "name", "filter_predicates": "=", "filter_values": ACTOR,
                                "detail": "true"})
    deadline = time.monotonic() + DEADLINE_S
    rows: list = []
    while time.monotonic() < deadline:
        r = httpx.get(f"{cluster.dashboard_url}/api/v0/actors?{q}", headers=cluster.dashboard_headers(), timeout=30)
        if r.status_code == 200:
            rows = r.json()["data"]["result"]["result"]
            if rows and rows[0]["state"] == "ALIVE":
                break
        time.sleep(1.0)
    assert len(rows) == 1, rows
    assert rows[0]["name"] == ACTOR and rows[0]["ray_namespace"] == "unbroken" and rows[0]["state"] == "ALIVE"
    assert rows[0]["class_name"] == "Reporter"
    # The same through the SDK's state API.
    from ray.util.state import list_actors

    listed = list_actors(address=cluster.dashboard_url, filters=[("name", "=", ACTOR)])
    assert [a.name for a in listed] == [ACTOR]

