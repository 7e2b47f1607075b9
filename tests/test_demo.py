"""`make demo` end to end: `python -m examples.demo` with a shorter job (the same kill at step 15).

The demo runs in a subprocess exactly as a user runs it. The test checks what a person sees
(the failure, the resize 4 -> 3, the restore, a summary with checkpoints), the facts behind it
in the demo's own job store (status, events, metrics, checkpoints), and that every process the
demo started (Ray's, SeaweedFS, the workers) is gone when it exits: the test records the demo's
process tree while it runs and checks each recorded process afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from examples.demo import descendants, still_alive

ROOT = Path(__file__).resolve().parents[1]
STEPS = 22  # checkpoints at 10 and 20; rank 1 dies after step 15, as in the full demo
KILL_STEP = 15


def _run_demo(run_dir: Path) -> tuple[int, str, dict[tuple[int, int], str]]:
    """Run the demo; returns its exit code, its output, and every process seen below it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("UNBROKEN_DEMO_STEPS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.demo", "--steps", str(STEPS), "--run-dir", str(run_dir)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    seen: dict[tuple[int, int], str] = {}
    stop = threading.Event()

    def record() -> None:
        while not stop.is_set():
            seen.update(descendants(proc.pid))
            stop.wait(0.5)

    watcher = threading.Thread(target=record, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the demo stops what it started on SIGTERM
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"the demo did not finish in 420 s; its output:\n{out}")
    finally:
        stop.set()
        watcher.join()
    return proc.returncode, out, seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    rc, out, seen = _run_demo(run_dir)

    # Nothing it started survives it (checked first: a leak must never outlive a failing test).
    deadline = time.monotonic() + 30
    left = still_alive(seen)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = still_alive(left)
    for pid, _ in left:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind by the demo: {left}\n{out}"
    assert len(seen) >= 10, f"the demo's process tree was not observed ({seen})"  # Ray, workers, weed
    assert "left behind" not in out, out  # its own orderly shutdown stopped everything

    assert rc == 0, out
    # What a person sees, in order: the failure, the resize, the recovery, then the summary.
    failure = re.search(r"FAILURE\s+Rank 1 \(worker-\d+ on node \w+\) was stopped by chaos \(kill_worker", out)
    resize = re.search(r"RESIZE\s+dp 4 -> 3", out)
    restored = re.search(r"RECOVERED\s+Recovered from the loss of rank 1 in [\d.]+s: .*\(step (\d+) from memory\)", out)
    summary = out.find("6. Summary")
    assert failure and resize and restored and summary > 0, out
    assert failure.start() < resize.start() < restored.start() < summary, out
    assert int(restored.group(1)) == KILL_STEP - 1 or int(restored.group(1)) == KILL_STEP, out
    assert f"SUCCEEDED; {STEPS} of {STEPS} steps" in out, out
    assert re.search(r"recovery\s+[\d.]+s from the fault to the next completed step: detect [\d.]+s, "
                     r"re-form [\d.]+s, restore [\d.]+s, replay [\d.]+s", out), out
    # The job's goodput: the recovery's pause (and the grow-back's, if it came before the end) counted.
    assert re.search(r"goodput\s+[01]\.\d\d of [\d.]+s since step 1 in steps; paused [\d.]+s in [12] re-forms? "
                     r"\(\w+ [\d.]+s.*\(client.goodput\)", out), out
    assert "checkpoints recorded by the service (client.checkpoints): 2" in out, out
    assert re.search(r"step-0+20\s+\d+ objects", out), out  # listed from S3 itself
    assert re.search(r"metrics\.jsonl: \S+ \(22 lines", out), out
    assert re.search(r"console: http://127\.0\.0\.1:\d+/ui", out), out
    assert "unbroken serve --address" in out and "ray start --head" in out, out  # the user's path

    # The facts behind the output, from the demo's own job store.
    from service.store import JobStore

    store = JobStore(f"sqlite:///{run_dir / 'home' / 'unbroken.db'}")
    try:
        jobs, _ = store.list_jobs()
        assert len(jobs) == 1 and jobs[0].status == "SUCCEEDED", jobs
        job_id = jobs[0].id
        events = store.events(job_id)
        kinds = [e.kind for e in events]
        assert {"failure_detected", "resized", "recovered", "checkpointed", "finished", "released"} <= set(kinds)
        shrink = next(e for e in events if e.kind == "resized")
        assert (shrink.data or {}).get("old_dp") == 4 and (shrink.data or {}).get("new_dp") == 3, shrink
        rows = store.metrics(job_id)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert {r["dp"] for r in rows if r["step"] < KILL_STEP} == {4}
        assert rows[KILL_STEP]["dp"] == 3  # step 16, the one the kill interrupted, ran on 3 workers
        assert rows[-1]["loss"] < rows[0]["loss"] - 1.0  # it learned (5.6 -> ~3 nats on real text)
        assert [c.step for c in store.checkpoints(job_id)] == [10, 20]
    finally:
        store.close()
    metrics_file = run_dir / "home" / "runs" / job_id / "metrics.jsonl"  # the job's own folder under serve
    assert len(metrics_file.read_text().splitlines()) == STEPS
