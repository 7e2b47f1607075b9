"""The Ray head dies mid-job and comes back (issue 17, item 2).

A cluster started as users start one (`ray start`), with GCS fault tolerance on a private Redis (the
head's tables under a namespace of the cluster's own) and the KubeRay layout: a head that runs no Ray
work, a control node (`unbroken_control`) for the supervisors, two worker nodes. A real `unbroken serve`
runs beside the head, as in the head pod. Mid-job the whole head is SIGKILLed (GCS, raylet, agents)
with the API; then the head is started again on the same address and the API again on the same store.

The job goes on: its supervisor and keepers are off the head; the restarted API finds it by name; it
finishes SUCCEEDED with at most one lost step per failure, and the losses of one process.

Marked `reliability`: part of `make test` (~80-110 s, beside other files); `make test-reliability` runs it alone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from examples.user_cluster import PrivateRedis, RayStartCluster, Serve
from tests.runtime.jobs import paced
from tests.runtime.test_user_path import job_spec as user_job_spec

STEPS = 60
KILL_AT_STEP = 8
KILL_WORKER_AT = 45


def job_spec() -> dict[str, Any]:
    spec = user_job_spec("head-restart")
    spec["training"]["steps"] = STEPS
    spec["resources"]["dp"] = {"min": 2, "max": 2}
    spec["fault_tolerance"]["wait_for_capacity_s"] = 300  # a replacement worker waits for the GCS to be back
    # Slow (every rank alike: no straggler) so the job still runs when the head is back, and a worker
    # killed late: a recovery needs the GCS (new actors, placement groups), after the restart or waiting for it.
    spec["chaos"] = paced(2, 0.5)
    spec["chaos"].append({"kind": "kill_worker", "step": KILL_WORKER_AT, "rank": 1, "generation": None})
    return spec


def reference_losses(tmp: Path) -> list[float]:
    """One process, no Ray, no chaos, the same engine: the trajectory the job must follow."""
    from service.spec import parse_spec
    from tests.runtime.jobs import engine_of
    from workers.launcher import run_local

    spec = job_spec()
    spec["chaos"] = []
    res = run_local(engine_of(parse_spec(spec)), 1, tmp / "ref", show_progress=False)
    return [json.loads(x)["loss"] for x in Path(res.metrics_path).read_text().splitlines()]


def _progress_step(client: Any, job_id: str) -> int:
    job = client.get(job_id)
    return int(job.progress.step or 0) if job.progress else 0


@pytest.mark.reliability
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_head_restart_mid_job(tmp_path: Path) -> None:
    redis = PrivateRedis(tmp_path / "redis")
    cluster: RayStartCluster | None = None
    serve: Serve | None = None
    try:
        cluster = RayStartCluster(head={"num-cpus": "0"}, gcs_redis=redis.address)
        cluster.add_node("ctl", num_cpus=0, params={"resources": '{"unbroken_control": 1}'})
        cluster.add_node("a", num_cpus=1)
        cluster.add_node("b", num_cpus=1)
        cluster.wait_nodes(4)
        home = tmp_path / "home"
        serve = Serve(home, address=cluster.address, env=cluster.env)
        serve.wait_ready()
        client = serve.client()
        job = client.submit(job_spec())
        deadline = time.monotonic() + 300
        while _progress_step(client, job.id) < KILL_AT_STEP:
            assert time.monotonic() < deadline, client.get(job.id)
            time.sleep(0.5)

        t_kill = time.time()
        step_at_kill = _progress_step(client, job.id)
        serve.stop()  # the API runs in the head pod: it goes with it
        cluster.kill_head()
        time.sleep(2)
        cluster.restart_head()
        t_head = time.time()
        serve = Serve(home, address=cluster.address, env=cluster.env)
        serve.wait_ready()
        t_api = time.time()
        client = serve.client()
        found = client.get(job.id)  # the restarted API finds the job again
        print(f"head restart: killed at step {step_at_kill}; head back in {t_head - t_kill:.1f}s, API in "
              f"{t_api - t_kill:.1f}s; the job is {found.status} at step {_progress_step(client, job.id)}")
        assert found.status in ("RUNNING", "RECOVERING", "SUCCEEDED"), found
        done = client.wait(job.id, timeout=600)
        assert done.status == "SUCCEEDED", done
        events = list(client.events(job.id, follow=False))
        for e in events:
            print(f"  {e.kind}: {e.message}")
        for e in events:
            if e.kind == "recovered":
                assert (e.data or {}).get("lost_steps", 0) <= 1, e.message
        rows = client.metrics(job.id)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert [r["loss"] for r in rows] == pytest.approx(reference_losses(tmp_path), abs=1e-4)
        (tmp_path / "measured.json").write_text(json.dumps({"head_back_s": t_head - t_kill,
                                                           "api_back_s": t_api - t_kill}))
    finally:
        if serve is not None:
            serve.stop()
        if cluster is not None:
            cluster.stop()
        redis.stop()
