"""End to end on a private Ray cluster: the API admits jobs through the scheduler, their
supervisors train and report, the queue holds a job until resources free up, cancel stops a
running job, a restarted control plane adopts a live supervisor, and a lost supervisor fails
its job."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from tests.control_plane import ControlPlane, store_as_an_older_version_did, until

CPUS = 2


def spec(tmp: Path, name: str, steps: int, cpus: float = 1.0) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"preset": "tiny"},
        "training": {"steps": steps, "seq_len": 32, "global_batch_size": 2, "warmup_steps": 1,
                     "output_dir": str(tmp / name)},
        "resources": {"dp": {"min": 1, "max": 1}, "cpus_per_worker": cpus},
        "checkpoint": {"uri": f"file://{tmp / name / 'ck'}", "persist_every": 0},
    }


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(address="local", num_cpus=CPUS, include_dashboard=False, namespace="unbroken", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_jobs_run_queue_cancel_restart_and_loss(ray_cluster: None, tmp_path: Path) -> None:
    from service.placement import job_placement_groups
    from service.supervisor import find_supervisor

    db = f"sqlite:///{tmp_path / 'e2e.db'}"
    cp = ControlPlane(db)
    try:
        with cp.client() as c:
            # A takes one CPU; B wants both, so it waits in the queue until A is done.
            a = c.submit(spec(tmp_path, "a", steps=6))
            b = c.submit(spec(tmp_path, "b", steps=3, cpus=CPUS))
            done_a = c.wait(a.id, timeout=300)
            assert done_a.status == "SUCCEEDED", done_a.reason
            assert done_a.progress.step == 6 and [m["step"] for m in c.metrics(a.id)][-1] == 6
            kinds = [e.kind for e in c.events(a.id, follow=False)]
            assert kinds[0] == "submitted" and {"admitted", "supervisor_started"} <= set(kinds)
            assert kinds.index("admitted") < kinds.index("supervisor_started")
            done_b = c.wait(b.id, timeout=300)
            assert done_b.status == "SUCCEEDED", done_b.reason
            waits = [e.message for e in c.events(b.id, follow=False) if e.kind == "waiting"]
            assert waits and "CPU" in waits[0]
            assert done_b.started_at >= done_a.finished_at  # type: ignore[operator]

            # A long job: running, then the control plane restarts and adopts it.
            long = c.submit(spec(tmp_path, "long", steps=100000))
            until(lambda: c.get(long.id).status == "RUNNING", 180, "the long job to run")
        cp.stop()
        cp = ControlPlane(db)
        with cp.client() as c:
            kinds = [e.kind for e in c.events(long.id, follow=False)]
            assert "adopted" in kinds and c.get(long.id).status == "RUNNING"
            step = c.get(long.id).progress.step or 0
            until(lambda: (c.get(long.id).progress.step or 0) > step, 120, "steps after the restart")
            c.cancel(long.id)
            assert c.wait(long.id, timeout=120, raise_on_failure=False).status == "CANCELLED"
            until(lambda: find_supervisor(long.id) is None, 60, "the cancelled job's supervisor to exit")

            # A supervisor that disappears fails its job with a reason.
            lost = c.submit(spec(tmp_path, "lost", steps=100000))
            until(lambda: c.get(lost.id).status == "RUNNING", 180, "the job to run")
            ray.kill(find_supervisor(lost.id), no_restart=True)
            final = c.wait(lost.id, timeout=60, raise_on_failure=False)
            assert final.status == "FAILED" and "supervisor" in (final.reason or "")
            # Its detached workers and placement group do not hold the cluster's CPUs after it.
            released = until(lambda: [e for e in c.events(lost.id, follow=False) if e.kind == "released"], 60,
                             "what the lost supervisor left to be released")
            assert released[0].data["actors and groups"] >= 2, released[0].message  # a worker and its group
            assert not job_placement_groups(lost.id)
            until(lambda: ray.available_resources().get("CPU", 0) >= CPUS, 60, "the lost job's CPU back")
    finally:
        cp.stop()


@pytest.mark.slow
def test_a_stored_spec_this_version_refuses_fails_its_job_alone(ray_cluster: None, tmp_path: Path) -> None:
    """After an upgrade that tightened the spec's rules, a queued job stored before fails with the field
    and the fix; a running one goes on at its size; every other job is scheduled as before."""
    db = f"sqlite:///{tmp_path / 'upgrade.db'}"
    cp = ControlPlane(db)
    try:
        with cp.client() as c:
            running = c.submit(spec(tmp_path, "running", steps=100000))
            until(lambda: c.get(running.id).status == "RUNNING", 180, "the long job to run")
            # Held in the queue by quota while the control plane is down, as a job submitted just before.
            stale = c.submit(spec(tmp_path, "stale", steps=3, cpus=CPUS))
        cp.stop()
        store_as_an_older_version_did(db, stale.id, {"access_key_id": "AKIAOLD"})
        store_as_an_older_version_did(db, running.id, {"endpoint_url": "127.0.0.1:8333"})
        cp = ControlPlane(db)
        with cp.client() as c:
            failed = c.wait(stale.id, timeout=60, raise_on_failure=False)
            assert failed.status == "FAILED", failed
            assert "its stored job spec does not validate under this version" in (failed.reason or "")
            assert "checkpoint.s3: access_key_id is set without secret_access_key" in (failed.reason or "")
            assert "resubmit the job with those fields fixed" in (failed.reason or "")
            assert "AKIAOLD" not in (failed.reason or "")
            # The pass went on: a job submitted now runs beside the running one.
            after = c.submit(spec(tmp_path, "after", steps=3))
            try:
                done = c.wait(after.id, timeout=300, raise_on_failure=False).status
            except TimeoutError:
                done = f"still {c.get(after.id).status}"
            assert done == "SUCCEEDED", "\n".join(
                [done, *(f"{e.kind}: {e.message}" for e in c.events(after.id, follow=False))])
            told = [e.message for e in c.events(running.id, follow=False) if e.kind == "spec_unreadable"]
            assert len(told) == 1 and "checkpoint.s3.endpoint_url" in told[0], told
            step = c.get(running.id).progress.step or 0
            until(lambda: (c.get(running.id).progress.step or 0) > step, 120, "the running job's next steps")
            assert c.get(running.id).status == "RUNNING"
            c.cancel(running.id)
            assert c.wait(running.id, timeout=120, raise_on_failure=False).status == "CANCELLED"
    finally:
        cp.stop()
