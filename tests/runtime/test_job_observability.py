"""A running job, watched the way a user watches it: submitted through the SDK to a real control
plane on a private Ray cluster (dashboard and metrics exporter on), with a worker killed mid-run.

While it runs, the test finds:
- every runtime metric of workers/telemetry.py on the Ray node's Prometheus endpoint, with the
  job's labels (job_id, and rank or cause or node): MFU excepted, which is GPU-only and must be
  absent rather than a made-up 0 on CPU;
- the control plane's metrics on the API's /metrics, the job's own series among them;
- the job's supervisor and workers by name in the dashboard's REST API (/api/v0/actors);
- the job's events in the supervisor's actor log (what the dashboard's log view shows);
and after it is cancelled, TensorBoard event files with its scalars and its recovery.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from service.local_cluster import LocalCluster
from tests.control_plane import ControlPlane, until
from tests.runtime.conftest import make_cluster
from tests.runtime.jobs import TINY_MODEL
from workers import telemetry

EXPORT_DEADLINE_S = 120.0  # Ray exports every ~10 s; a loaded 2-core machine is slower
KILLED_AT = 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from make_cluster(3, {}, observed=True)


def job_spec(out: Path) -> dict[str, Any]:
    return {
        "name": "watched",
        "model": TINY_MODEL,
        # A held-out split evaluated every 5 steps, so the eval-loss series is exported too.
        "data": {"kind": "text", "path": "/usr/lib/python3.11/json", "eval": {"split": 0.1}},
        "training": {"steps": 100_000, "seq_len": 16, "global_batch_size": 8, "output_dir": str(out),
                     "eval_every": 5},
        "parallelism": {"dp_shard": 2},
        "resources": {"cpus_per_worker": 0.5, "dp": {"min": 1, "max": 2}},
        "checkpoint": {"uri": (out / "ck").as_uri(), "persist_every": 5, "in_memory_every": 1, "keep_last": 2},
        "fault_tolerance": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30, "collective_timeout_s": 20,
                            "wait_for_capacity_s": 30},
        "chaos": [{"kind": "kill_worker", "step": KILLED_AT, "rank": 1}],
        "tensorboard": True,
    }


Samples = list[tuple[str, dict[str, str], float]]


def scrape(url: str) -> Samples:
    text = httpx.get(url, timeout=10).text
    return [(s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def find(samples: Samples, metric: str, /, **labels: str) -> list[float]:
    return [v for n, lab, v in samples if n == metric and all(lab.get(k) == x for k, x in labels.items())]


def missing_runtime_metrics(samples: Samples, job_id: str) -> list[str]:
    """Every exported series of every runtime metric, with this job's labels (MFU: none on CPU)."""
    out = []
    for m in telemetry.METRICS:
        if m.name == "unbroken_mfu":
            continue
        for series in m.exported:
            if "job_id" in m.tag_keys:
                rows = [lab for n, lab, _ in samples if n == series and lab.get("job_id") == job_id]
                if "rank" in m.tag_keys:
                    rows = [lab for lab in rows if lab.get("rank") in ("0", "1")]
                if "cause" in m.tag_keys:
                    rows = [lab for lab in rows if lab.get("cause")]
            else:  # the keepers' memory is per node: the job runs on the head only
                rows = [lab for n, lab, _ in samples if n == series and lab.get("node") == "head"]
            if not rows:
                out.append(series)
    return out


def dashboard_actors(cluster: LocalCluster, prefix: str) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"detail": "true", "limit": 1000})
    r = httpx.get(f"{cluster.dashboard_url}/api/v0/actors?{q}", headers=cluster.dashboard_headers(), timeout=30)
    r.raise_for_status()
    return [a for a in r.json()["data"]["result"]["result"] if str(a.get("name", "")).startswith(prefix)]


@pytest.mark.slow
def test_running_job_metrics_actors_logs_and_tensorboard(cluster: LocalCluster, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert cluster.metrics_export_port is not None and cluster.dashboard_url is not None
    # The dashboard we are about to ask is this cluster's (not one left by another test).
    version = httpx.get(f"{cluster.dashboard_url}/api/version", headers=cluster.dashboard_headers(), timeout=30).json()
    assert version["session_name"] == ray._private.worker.global_worker.node.session_name, version

    cp = ControlPlane(f"sqlite:///{tmp_path / 'jobs.db'}")
    try:
        with cp.client() as c:
            job = c.submit(job_spec(tmp_path / "run"))
            jid = job.id

            def recovered_and_checkpointed() -> bool:
                kinds = [e.kind for e in c.events(jid, follow=False)]
                return "recovered" in kinds and "checkpointed" in kinds and c.get(jid).status == "RUNNING"

            until(recovered_and_checkpointed, 300, "the job to recover from the kill and checkpoint", every_s=1.0)

            # 1. The node's Prometheus endpoint, with the job's labels.
            node_url = f"http://127.0.0.1:{cluster.metrics_export_port}/metrics"
            samples: Samples = []

            def all_exported() -> bool:
                nonlocal samples
                samples = scrape(node_url)
                # The keeper's gauge exists from its first report, taken before it held anything.
                held = find(samples, telemetry.PREFIX + "unbroken_keeper_memory_bytes", node="head")
                # Generation 0's gauge exists from the start: the export after the recovery sets it to 1 or
                # more (Ray exports every ~10 s, and the recovery's event can come before its export).
                formed = find(samples, telemetry.PREFIX + "unbroken_generation", job_id=jid)
                return (not missing_runtime_metrics(samples, jid) and max(held, default=0) > 0
                        and max(formed, default=0) >= 1)

            try:
                until(all_exported, EXPORT_DEADLINE_S, "every runtime metric", every_s=2.0)
            except AssertionError:
                gens = find(samples, telemetry.PREFIX + "unbroken_generation", job_id=jid)
                pytest.fail(f"not on {node_url} with job_id={jid}: {missing_runtime_metrics(samples, jid)}; "
                            f"unbroken_generation {gens} (1 or more after the recovery)")
            p = telemetry.PREFIX
            # The kill is detected as the worker's death, or (a race) first as its peer's broken collective.
            causes = {lab["cause"] for n, lab, _ in samples if n == p + "unbroken_recoveries_total"
                      and lab.get("job_id") == jid}
            assert causes <= {"worker_died", "collective_error"} and causes, causes
            # The recovery's pause of training, under its failure's kind (and a grow back's, if one came).
            paused = {lab["cause"] for n, lab, _ in samples if n == p + "unbroken_pause_seconds_count"
                      and lab.get("job_id") == jid}
            assert paused & causes and paused <= causes | {"growth"}, (paused, causes)
            assert sum(find(samples, p + "unbroken_recoveries_total", job_id=jid)) >= 1
            assert max(find(samples, p + "unbroken_generation", job_id=jid)) >= 1
            assert set(find(samples, p + "unbroken_dp_degree", job_id=jid)) <= {1.0, 2.0}
            assert all(v > 0 for v in find(samples, p + "unbroken_tokens_per_s", job_id=jid))
            assert all(v >= KILLED_AT for v in find(samples, p + "unbroken_step", job_id=jid, rank="0"))
            assert all(v > 0 for v in find(samples, p + "unbroken_snapshot_bytes", job_id=jid))
            assert all(v > 0 for v in find(samples, p + "unbroken_checkpoint_bytes", job_id=jid))
            assert max(find(samples, p + "unbroken_keeper_memory_bytes", node="head")) > 0
            assert not find(samples, p + "unbroken_mfu", job_id=jid), "MFU on CPU must be absent, not 0"

            # 2. The API's /metrics: the control plane's own, and this job's series.
            api = scrape(f"{cp.server.url}/metrics")
            assert find(api, "unbroken_job_info", job_id=jid, name="watched", status="RUNNING") == [1.0]
            assert find(api, "unbroken_job_step", job_id=jid)[0] >= KILLED_AT
            assert find(api, "unbroken_job_recoveries", job_id=jid)[0] >= 1
            assert find(api, "unbroken_jobs", status="RUNNING") == [1.0]
            assert find(api, "unbroken_queue_length") == [0.0]
            assert sum(find(api, "unbroken_api_requests_total", method="POST", status="201")) >= 1
            assert find(api, "unbroken_api_request_seconds_count")

            # 3. The dashboard's actor view reads as the job's structure.
            prefix = f"job-{jid}/"
            workers_now = set(ray.get(ray.get_actor(f"{prefix}supervisor").status.remote(), timeout=30)["workers"])
            rows: list[dict[str, Any]] = []

            def listed() -> bool:
                nonlocal rows
                rows = dashboard_actors(cluster, prefix)
                alive = {a["name"] for a in rows if a["state"] == "ALIVE"}
                return {f"{prefix}supervisor", *workers_now} <= alive

            try:
                until(listed, 90, "the job's actors in the dashboard", every_s=2.0)
            except AssertionError:
                pytest.fail(f"dashboard lists {[(a['name'], a['state']) for a in rows]}, want {workers_now}")
            by_name = {a["name"]: a for a in rows}
            assert by_name[f"{prefix}supervisor"]["class_name"] == "Supervisor"
            assert all(by_name[w]["class_name"] == "Worker" and by_name[w]["ray_namespace"] == "unbroken"
                       for w in workers_now)
            assert any(a["state"] == "DEAD" for a in rows), "the killed worker is listed as DEAD"

            # 4. The supervisor's log holds the job's events.
            from ray.util.state import get_log

            sup_id = by_name[f"{prefix}supervisor"]["actor_id"]

            last = ["no answer yet"]

            def logged() -> str:
                from ray.util.state.exception import RayStateApiException

                try:
                    text = "".join(get_log(actor_id=sup_id, address=cluster.address, tail=5000, timeout=30))
                except RayStateApiException as e:  # the node's dashboard agent is not registered yet
                    last[0] = f"{type(e).__name__}: {str(e)[:300]}"
                    return ""
                last[0] = f"{len(text)} chars ending {text[-400:]!r}"
                return text if f"job {jid}: recovered:" in text else ""

            # Ray's log API answers slowly while the cores are busy (another test file beside this one).
            try:
                log_text = until(logged, 180, "the job's events in the supervisor's log", every_s=2.0)
            except AssertionError:
                pytest.fail(f"no 'recovered' event in the supervisor's log after 180 s; Ray's last answer: {last[0]}")
            assert f"job {jid}: failure_detected:" in log_text and f"job {jid}: generation:" in log_text

            c.cancel(jid)
            assert c.wait(jid, timeout=120, raise_on_failure=False).status == "CANCELLED"

        # 5. TensorBoard: the job's scalars and its recovery, read back by TensorBoard's own reader.
        tb_dir = tmp_path / "run" / "tensorboard"
        until(lambda: list(tb_dir.glob("events.out.tfevents.*")), 30, "TensorBoard event files")
        acc = EventAccumulator(str(tb_dir))
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "elastic/dp_degree"} <= tags
        steps = [e.step for e in acc.Scalars("train/loss")]
        assert steps == sorted(set(steps)) and steps[0] == 1 and len(steps) > KILLED_AT
        texts = [t for t in acc.Tags()["tensors"] if t.startswith("elastic/events")]
        assert texts, acc.Tags()
        recovered = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(texts[0])]
        assert any("worker_died" in t or "collective_error" in t for t in recovered), recovered
    finally:
        cp.stop()
