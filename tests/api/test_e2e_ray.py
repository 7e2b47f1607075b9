"""End to end on a private Ray cluster: the API admits jobs through the scheduler, their
supervisors train and report, the queue holds a job until resources free up, cancel stops a
running job, a restarted control plane adopts a live supervisor, and a lost supervisor fails
its job."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("service.supervisor", reason="the supervisor (service/supervisor.py) is not built yet")

import ray  # noqa: E402

from api.app import create_app  # noqa: E402
from api.client import Client  # noqa: E402
from api.server import BackgroundServer  # noqa: E402
from service.scheduler import Scheduler  # noqa: E402
from service.store import JobStore  # noqa: E402

CPUS = 2


def until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


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


class ControlPlane:
    def __init__(self, db: str) -> None:
        self.store = JobStore(db)
        self.scheduler = Scheduler(self.store, interval_s=0.2, liveness_every_s=1.0)
        self.scheduler.start()
        self.server = BackgroundServer(create_app(self.store, self.scheduler)).start()
        self.token = self.store.create_token("e2e", "user")

    def client(self) -> Client:
        return Client(self.server.url, self.token)

    def stop(self) -> None:
        self.server.stop()
        self.scheduler.stop()
        self.store.close()


@pytest.mark.slow
def test_jobs_run_queue_cancel_restart_and_loss(ray_cluster: None, tmp_path: Path) -> None:
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
            assert c.wait(long.id, timeout=120).status == "CANCELLED"
            until(lambda: find_supervisor(long.id) is None, 60, "the cancelled job's supervisor to exit")

            # A supervisor that disappears fails its job with a reason.
            lost = c.submit(spec(tmp_path, "lost", steps=100000))
            until(lambda: c.get(lost.id).status == "RUNNING", 180, "the job to run")
            ray.kill(find_supervisor(lost.id), no_restart=True)
            final = c.wait(lost.id, timeout=60)
            assert final.status == "FAILED" and "supervisor" in (final.reason or "")
    finally:
        cp.stop()
