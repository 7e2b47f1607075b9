"""Shrink to share, grow to fill (issue 15), through the real control plane (job store, scheduler, REST
API, SDK and CLI) on a private Ray cluster with room for exactly six 0.5-CPU workers.

A low-priority elastic job runs at dp 4 beside a second low job at dp 2 (dp.min 1), and the cluster is
full. A priority-10 job needing 2 workers arrives: only one job must shrink, and the least disruptive
choice is the first (4→2) rather than both (4→3 and 2→1). The scheduler asks the low job to shrink
4→2 (an event with the reason), its supervisor pauses at a committed snapshot and re-forms at dp 2
from memory (0 steps lost), the high job is admitted once the capacity is really free, runs and
finishes, and the low job grows back 2→4 ("capacity freed by job ..."; in two resizes, 2→3→4, where
one of its new workers is ready more than the scaling policy's grow wait after the other).
Every step of the low job is there once, and its losses equal one process's uninterrupted run
(≤1e-4): resizing did not change its trajectory.

The low job is long (a constant learning rate after warm-up, so a shorter run's schedule is the same)
and is cancelled a few steps after it grew back; the reference runs exactly the steps it completed.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from examples.user_cluster import UNBROKEN, RayStartCluster, Serve
from service.local_cluster import LocalCluster
from tests.control_plane import ControlPlane, until
from tests.runtime.conftest import make_cluster
from tests.runtime.jobs import assert_same_losses, engine_of, paced, tiny_spec

AFTER_GROWTH = 4  # steps the low job trains at dp 4 again before the test cancels it
PACE_S = 0.2  # the long-running jobs' pause before each step (see spec)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from make_cluster(3, {})


def spec(out: Path, *, steps: int, dp: int, dp_min: int, priority: int, name: str, pace_s: float = 0.0) -> Any:
    """`pace_s`: every rank sleeps that long before each step (chaos slow_worker), so a job that only
    has to keep running leaves the 3 CPUs to the jobs starting beside it (and its reference run is short)."""
    chaos = paced(dp, pace_s) if pace_s else None
    s = tiny_spec(out, steps=steps, dp=dp, dp_min=dp_min, chaos=chaos)
    training = s.training.model_copy(update={"min_lr_ratio": 1.0})  # constant after warm-up: see above
    return s.model_copy(update={"training": training, "priority": priority, "name": name})


def events(client: Any, job_id: str) -> list[Any]:
    return list(client.events(job_id, follow=False))


def of(evs: list[Any], kind: str) -> list[Any]:
    return [e for e in evs if e.kind == kind]


def rows_of(client: Any, job_id: str) -> list[dict[str, Any]]:
    return client.metrics(job_id)


@pytest.mark.timeout(600)
def test_low_priority_job_shrinks_for_a_high_one_and_grows_back(
        cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNBROKEN_HOME", str(tmp_path / "home"))
    cp = ControlPlane(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        client = cp.client()
        low = client.submit(spec(tmp_path / "low", steps=100_000, dp=4, dp_min=2, priority=0, name="low",
                                 pace_s=PACE_S))
        until(lambda: (p := client.get(low.id).progress).dp == 4 and (p.step or 0) >= 3, 240, "low at dp 4")
        other = client.submit(spec(tmp_path / "other", steps=100_000, dp=2, dp_min=1, priority=0, name="other",
                                   pace_s=PACE_S))
        until(lambda: (p := client.get(other.id).progress).dp == 2 and (p.step or 0) >= 1, 240, "other at dp 2")
        high = client.submit(spec(tmp_path / "high", steps=8, dp=2, dp_min=2, priority=10, name="high"))

        # The scheduler's decision, with its reason, on both jobs; the CLI shows dp now / target.
        shrink = until(lambda: of(events(client, low.id), "shrink"), 60, "the shrink decision")[0]
        assert shrink.message == f"shrunk 4→2 to admit job {high.id}, priority 10", shrink.message
        env = {**os.environ, "UNBROKEN_URL": cp.server.url, "UNBROKEN_TOKEN": cp.token}
        listed = subprocess.run([UNBROKEN, "list"], env=env, capture_output=True, text=True, timeout=120)
        row = next(ln for ln in listed.stdout.splitlines() if ln.startswith(low.id))
        assert "DP/TARGET" in listed.stdout and ("4/2" in row or "2/2" in row), listed.stdout
        status = subprocess.run([UNBROKEN, "status", low.id], env=env, capture_output=True, text=True, timeout=120)
        assert "target dp: 2" in status.stdout and "shrunk 4→2" in status.stdout, status.stdout

        done = client.wait(high.id, timeout=300)
        assert done.status == "SUCCEEDED", done
        high_evs = events(client, high.id)
        assert any("shrinks" in e.message for e in of(high_evs, "waiting")), [e.message for e in high_evs]

        grow = until(lambda: of(events(client, low.id), "grow"), 120, "the growth decision")[0]
        assert grow.message == f"grown 2→4: capacity freed by job {high.id}", grow.message
        grown = until(lambda: [e for e in of(events(client, low.id), "resized") if (e.data or {}).get("new_dp") == 4],
                      240, "the low job grown back to dp 4")[0]
        until(lambda: [r for r in rows_of(client, low.id) if r["step"] > grown.data["step"] + AFTER_GROWTH], 240,
              f"{AFTER_GROWTH} steps at dp 4 again")
        for job in (low, other):
            client.cancel(job.id)
            final = client.wait(job.id, timeout=120, raise_on_failure=False)
            assert final.status == "CANCELLED", final
        # Only one job had to shrink: the other low job kept its dp 2 throughout.
        other_evs = events(client, other.id)
        assert not of(other_evs, "shrink") and not of(other_evs, "resized"), [e.message for e in other_evs]
        assert {r["dp"] for r in rows_of(client, other.id)} == {2}

        # The high job ran while the low one was at dp 2, at its own dp 2, to its end.
        high_rows = rows_of(client, high.id)
        assert [r["step"] for r in high_rows] == list(range(1, 9)) and {r["dp"] for r in high_rows} == {2}

        evs = events(client, low.id)
        resized = [(e.data["old_dp"], e.data["new_dp"], e.data["cause"], e.data.get("lost_steps"))
                   for e in of(evs, "resized")]
        # Back to 4 in one resize, or in two where one new worker was ready more than the scaling
        # policy's grow wait (2 s) before the other: the policy grows with what is ready then.
        told = [(e.kind, e.message[:300]) for e in evs if e.kind in ("resized", "failure_detected", "recovered")]
        assert resized[0] == (4, 2, "scheduler", 0), told
        grows = resized[1:]
        assert grows in ([(2, 4, "scheduler", 0)], [(2, 3, "scheduler", 0), (3, 4, "scheduler", 0)]), told
        assert "failure_detected" not in [e.kind for e in evs]
        rows = rows_of(client, low.id)
        dps = [r["dp"] for r in rows]
        first2, last2 = dps.index(2), len(dps) - 1 - dps[::-1].index(2)
        after = dps[last2 + 1:]
        assert set(dps[:first2]) == {4} and set(dps[first2:last2 + 1]) == {2}, dps
        assert after == sorted(after) and after[-1] == 4 and set(after) == {new for _, new, _, _ in grows}, dps

        # Every step once, and the losses of one uninterrupted process over the same steps.
        from workers.launcher import run_local

        ref_spec = spec(tmp_path / "ref", steps=len(rows), dp=1, dp_min=1, priority=0, name="ref")
        ref = run_local(engine_of(ref_spec), 1, tmp_path / "ref", show_progress=False)
        ref_rows = [json.loads(x) for x in Path(ref.metrics_path).read_text().splitlines()]
        assert_same_losses(rows, ref_rows, tol=1e-4)

        # The decisions on Prometheus.
        text = httpx.get(f"{cp.server.url}/metrics", timeout=30).text
        assert 'unbroken_scheduler_decisions_total{kind="shrink"} 1.0' in text, text[-2000:]
        assert 'unbroken_scheduler_decisions_total{kind="grow"} 1.0' in text
    finally:
        cp.stop()


# ----------------------------------------------------------------------------- the autoscaler
def fake_autoscaling_cluster(tmp: Path) -> RayStartCluster:
    """`ray start --head` with Ray's fake multi-node autoscaler (what ray.cluster_utils.AutoscalingCluster
    starts, but on a private port and temp dir and stopped by PID: AutoscalingCluster runs `ray stop
    --force`, which would stop every Ray cluster on the machine). The head has 1 CPU; the autoscaler may
    add one 2-CPU node and removes it 6 s after it is idle."""
    import ray._private.services as services

    from workers.ports import free_port

    port = free_port()
    config = {
        "cluster_name": "unbroken-fake", "max_workers": 1,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": f"{services.get_node_ip_address()}:{port}"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "cpu2": {"resources": {"CPU": 2}, "node_config": {}, "min_workers": 0, "max_workers": 1},
        },
        "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1,
        "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [], "rsync_exclude": [], "rsync_filter": [],
    }
    path = tmp / "autoscaling.json"
    path.write_text(json.dumps(config))
    return RayStartCluster(head={"num-cpus": "1", "autoscaling-config": str(path), "port": str(port)})


def alive_nodes(url: str, token: str) -> list[dict[str, Any]]:
    got = httpx.get(f"{url}/v1/cluster", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
    return [n for n in got["nodes"] if n["alive"]]


@pytest.mark.timeout(600)
def test_queued_demand_brings_a_node_from_the_autoscaler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job that waits for capacity is asked of Ray's autoscaler (request_resources): a node is added,
    the job is admitted on it and finishes, the request is released and the idle node removed."""
    monkeypatch.setenv("RAY_FAKE_CLUSTER", "1")  # the fake provider's switch, inherited by `ray start`
    monkeypatch.setenv("AUTOSCALER_UPDATE_INTERVAL_S", "1")
    cluster = fake_autoscaling_cluster(tmp_path)
    serve = None
    try:
        serve = Serve(tmp_path / "home", address=cluster.address, env=cluster.env)
        serve.wait_ready()
        client = serve.client()
        url, token = serve.url, client.token
        (head,) = (n["node_id"] for n in alive_nodes(url, token))
        first = client.submit(spec(tmp_path / "a", steps=100_000, dp=2, dp_min=2, priority=0, name="first"))
        until(lambda: (client.get(first.id).progress.step or 0) >= 1, 240, "the first job training on the head")
        second = client.submit(spec(tmp_path / "b", steps=5, dp=2, dp_min=2, priority=0, name="second"))
        until(lambda: len(alive_nodes(url, token)) == 2, 180, "the autoscaler adding a node")
        # The second job's workers run on the added node (Ray's node ids: the fake nodes' names collide).
        placed = until(lambda: {n["node_id"] for n in alive_nodes(url, token) if n["workers"].get(second.id)}
                       or client.get(second.id).terminal, 240, "the second job's workers placed")
        assert placed is not True and head not in placed, (head, placed)
        done = client.wait(second.id, timeout=300)
        assert done.status == "SUCCEEDED", done
        waited = [e.message for e in events(client, second.id) if e.kind == "waiting"]
        assert waited and "free now" in waited[0], waited
        until(lambda: len(alive_nodes(url, token)) == 1, 180, "the idle node removed after the request's release")
        client.cancel(first.id)
        assert client.wait(first.id, timeout=120, raise_on_failure=False).status == "CANCELLED"
    finally:
        if serve is not None:
            serve.stop()
        cluster.stop()
