"""The SDK's wait(): typed outcomes for FAILED and CANCELLED, a small progress object for the
callback, and reads that behave on a job with no rows; against a real store-only server."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import unbroken
from api.client import Client, JobProgress
from tests.api.conftest import Api

TINY = {"name": "tiny", "model": {"preset": "tiny"}, "training": {"steps": 3}}


def _later(fn: object, delay_s: float = 0.3) -> threading.Thread:
    t = threading.Timer(delay_s, fn)  # type: ignore[arg-type]
    t.start()
    return t


def test_wait_hands_the_callback_one_progress_line_per_change(api: Api) -> None:
    _, token = api.user()
    seen: list[JobProgress] = []
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        s = api.store

        def run() -> None:
            s.set_status(j.id, "RUNNING")
            time.sleep(0.3)
            s.add_metrics(j.id, [{"step": 1, "loss": 5.25, "dp": 2, "generation": 0, "tokens_per_s": 1234.5}])
            time.sleep(0.3)
            s.add_metrics(j.id, [{"step": 3, "loss": 4.5, "dp": 2, "generation": 0, "tokens_per_s": 1500.0}])
            s.set_status(j.id, "SUCCEEDED")

        t = _later(run, 0.2)
        done = c.wait(j.id, timeout=30, progress_callback=seen.append, poll_s=0.05)
        t.join()
    assert done.status == "SUCCEEDED"
    # Polled many times, but called only when something changed: no two equal neighbours.
    assert all(a != b for a, b in zip(seen, seen[1:], strict=False)), seen
    assert seen[0].status == "PENDING" and seen[-1].status == "SUCCEEDED" and seen[-1].step == 3
    assert str(seen[0]) == f"job {j.id} PENDING, step 0/3"
    mid = next(p for p in seen if p.step == 1)
    assert str(mid) == f"job {j.id} RUNNING, step 1/3, loss 5.2500, 1,234 tokens/s, dp 2, generation 0"
    assert all("\n" not in str(p) and "spec" not in str(p) and "None" not in str(p) for p in seen)
    with pytest.raises(AttributeError):
        seen[0].step = 9  # type: ignore[misc]  # frozen


def test_wait_raises_job_failed_with_its_reason(api: Api) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        api.store.set_status(j.id, "RUNNING")
        api.store.set_status(j.id, "RECOVERING", "worker 1 died")
        t = _later(lambda: api.store.set_status(j.id, "FAILED", "recoveries exhausted (10 of 10)"))
        last: list[JobProgress] = []
        with pytest.raises(unbroken.JobFailed) as info:
            c.wait(j.id, timeout=30, progress_callback=last.append, poll_s=0.05)
        t.join()
        assert info.value.reason == "recoveries exhausted (10 of 10)" and info.value.job.id == j.id
        assert info.value.job.status == "FAILED" and info.value.job.progress.recoveries == 1
        assert str(info.value) == f"job {j.id} (tiny) FAILED: recoveries exhausted (10 of 10)"
        assert isinstance(info.value, unbroken.UnbrokenError) and not isinstance(info.value, unbroken.JobCancelled)
        assert str(last[-1]).endswith("FAILED, step 0/3, 1 recovery: recoveries exhausted (10 of 10)")
        # Told not to raise, it returns the final job.
        assert c.wait(j.id, timeout=5, raise_on_failure=False).status == "FAILED"


def test_wait_raises_job_cancelled_not_job_failed(api: Api) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        t = _later(lambda: c.cancel(j.id))
        with pytest.raises(unbroken.JobCancelled) as info:
            c.wait(j.id, timeout=30, poll_s=0.05)
        t.join()
        assert not isinstance(info.value, unbroken.JobFailed)
        assert info.value.job.status == "CANCELLED" and f"job {j.id} (tiny) was CANCELLED" in str(info.value)
        assert c.wait(j.id, raise_on_failure=False).status == "CANCELLED"


def test_reads_of_a_job_with_no_rows_are_empty(api: Api) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        assert c.metrics(j.id) == [] and c.checkpoints(j.id) == []
        assert [e.kind for e in c.events(j.id, follow=False)] == ["submitted"]
        assert str(JobProgress.of(c.get(j.id))) == f"job {j.id} PENDING, step 0/3"


def test_metrics_returns_every_page(api: Api) -> None:
    """More rows than one page holds, with a step's two rows (a replay) across the page boundary."""
    _, token = api.user()
    with Client(api.url, token) as c:
        j = c.submit(TINY)
        steps = [*range(1, 10000), 9999, 10000, 10001, 10002]
        api.store.add_metrics(j.id, [{"step": s, "loss": 1.0} for s in steps])
        got = c.metrics(j.id)
        assert [r["step"] for r in got] == steps and got[-1]["step"] == 10002
        assert [r["step"] for r in c.metrics(j.id, after_step=10000)] == [10001, 10002]


def test_the_public_names_import_neither_torch_nor_ray() -> None:
    code = ("import sys\nfrom unbroken import Client, JobFailed, JobCancelled, JobProgress\n"
            "from api import client\n"
            "print(sorted({'torch', 'ray'} & {m.split('.')[0] for m in sys.modules}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
