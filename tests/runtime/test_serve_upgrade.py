"""Through a real `unbroken serve` process on a `ray start` cluster, with the SDK: an upgraded control
plane meets stored jobs whose specs the new version refuses, and a job whose supervisor is lost for good.

The serve process is stopped and started again on the same home (its SQLite store) and address, as an
upgrade restarts it; the rows an older version wrote are put in the store meanwhile. A queued job with
such a spec fails with the field and the fix, a running one trains on, and jobs after them are scheduled.
The running job's worker then ends, and its replacement (a worker of the earlier serve's Ray job) starts.
Then the running job's supervisor is killed for good from another Ray driver (as an operator, or Ray out
of restarts, would end it): serve fails the job and releases what it left, so a job that needs every CPU
of the cluster runs next.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from examples.user_cluster import RayStartCluster, Serve
from tests.control_plane import store_as_an_older_version_did, until
from tests.runtime.jobs import paced
from tests.runtime.test_user_path import LONG, PACE_S, _stop, job_spec

CPUS = 2

KILL_SUPERVISOR = """
import sys, ray
from checkpointing.naming import NAMESPACE, supervisor_name
ray.init(address=sys.argv[1], namespace=NAMESPACE, log_to_driver=False)
ray.kill(ray.get_actor(supervisor_name(sys.argv[2]), namespace=NAMESPACE), no_restart=True)
"""


def _succeeds(client: Any, job_id: str, timeout: float = 300) -> None:
    """The job ends SUCCEEDED; else its status and every event of it."""
    try:
        status = client.wait(job_id, timeout=timeout, raise_on_failure=False).status
    except TimeoutError:
        status = f"still {client.get(job_id).status} after {timeout:g} s"
    assert status == "SUCCEEDED", "\n".join([status, *(f"{e.kind}: {e.message}" for e in client.events(job_id, follow=False))])


def _one_worker(name: str, *, steps: int, cpus: int = 1, chaos: list | None = None) -> dict:
    spec = job_spec(name, chaos, steps=steps, dp=(1, 1))
    spec["resources"]["cpus_per_worker"] = cpus
    return spec


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_upgrade_meets_refused_specs_and_a_lost_supervisor_releases_its_job(tmp_path: Path) -> None:
    cluster = RayStartCluster(head={"num-cpus": str(CPUS)})
    ok = False
    home = tmp_path / "home"
    serve = Serve(home, address=cluster.address, env=cluster.env)
    try:
        serve.wait_ready()
        client = serve.client()
        running = client.submit(_one_worker("running", steps=LONG, chaos=paced(1, PACE_S)))
        until(lambda: (client.get(running.id).progress.step or 0) >= 2, 300, "the long job's steps")
        stale = client.submit(_one_worker("stale", steps=3, cpus=CPUS))  # waits: one CPU is taken
        serve.stop()

        db = f"sqlite:///{home / 'unbroken.db'}"
        store_as_an_older_version_did(db, stale.id, {"access_key_id": "AKIAOLD"})
        store_as_an_older_version_did(db, running.id, {"endpoint_url": "127.0.0.1:8333"})
        serve = Serve(home, address=cluster.address, env=cluster.env, port=serve.port)
        serve.wait_ready()
        client = serve.client()
        failed = client.wait(stale.id, timeout=120, raise_on_failure=False)
        reason = failed.reason or ""
        assert failed.status == "FAILED", failed
        assert "checkpoint.s3: access_key_id is set without secret_access_key" in reason, reason
        assert "resubmit the job with those fields fixed" in reason and "AKIAOLD" not in reason, reason
        after = client.submit(_one_worker("after", steps=3))
        _succeeds(client, after.id)
        told = [e.message for e in client.events(running.id, follow=False) if e.kind == "spec_unreadable"]
        assert len(told) == 1 and "checkpoint.s3.endpoint_url" in told[0], told
        step = client.get(running.id).progress.step or 0
        until(lambda: (client.get(running.id).progress.step or 0) > step, 120, "the running job's next steps")

        # Its worker ends (SIGTERM, as a kubelet or `kill` sends it): the replacement is a new worker process
        # of the earlier serve's Ray job, whose driver has exited. The raylet starts it (the job's detached
        # supervisor keeps that Ray job alive) and the job recovers from the keeper's memory.
        workers = until(lambda: (w := cluster.pids_running("head", "Worker")) and len(w) == 1 and w, 60,
                        "the running job's worker alone (the job after it has ended)")
        os.kill(workers[0], signal.SIGTERM)
        recovered = until(lambda: [e for e in client.events(running.id, follow=False) if e.kind == "recovered"],
                          180, "the recovery of the earlier serve's job")
        assert (recovered[0].data or {}).get("lost_steps", 9) <= 1, recovered[0].message
        after = cluster.pids_running("head", "Worker")
        assert after and workers[0] not in after, (workers, after)  # a new worker process took its place
        step = client.get(running.id).progress.step or 0
        until(lambda: (client.get(running.id).progress.step or 0) > step, 120, "the recovered job's next steps")

        subprocess.run([sys.executable, "-c", KILL_SUPERVISOR, cluster.address, running.id], env=cluster.env,
                       check=True, timeout=120, cwd=Path(__file__).parents[2])
        lost = client.wait(running.id, timeout=120, raise_on_failure=False)
        assert lost.status == "FAILED" and "supervisor" in (lost.reason or ""), lost
        released = until(lambda: [e for e in client.events(running.id, follow=False) if e.kind == "released"],
                         120, "what the lost supervisor left to be released")
        got = released[0].data or {}
        # Its worker, node agent and placement group; its snapshot copies on the keeper.
        assert got["actors and groups"] >= 3 and got["keeper bytes"] > 0, released[0].message
        # Both CPUs are free again: a job that needs them all runs.
        full = client.submit(_one_worker("full", steps=3, cpus=CPUS))
        _succeeds(client, full.id)
        ok = True
    finally:
        serve.stop()
        _stop(cluster, ok)
