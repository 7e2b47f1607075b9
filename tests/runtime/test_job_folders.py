"""Each job's state is its own: its folder, its checkpoint root, and resuming only on request.

- service.job_paths: the default folder is <runs_root>/<job-id>, a checkpoint root gets /<job-id>;
- a job never writes into another job's folder (it fails at start, naming the owner);
- checkpoint.resume_from starts a job from another run's checkpoints, read only, and the losses
  go on as if the first run had continued (batch invariance).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.job_paths import OWNER_MARKER, claim_folder, folder_owner, resolve_job_paths
from tests.runtime.jobs import JobRun, assert_same_losses, tiny_spec


def test_job_paths_rule(tmp_path: Path) -> None:
    spec = tiny_spec(tmp_path / "x")
    spec.training.output_dir = None
    a = resolve_job_paths(spec, "job-a", tmp_path / "runs")
    assert a.training.output_dir == str((tmp_path / "runs" / "job-a").resolve())
    assert a.checkpoint.uri is None  # <output>/checkpoints, inside the job's folder
    spec.checkpoint.uri = "s3://bucket/runs"
    spec.training.output_dir = "named"
    b = resolve_job_paths(spec, "job-b", tmp_path / "runs")
    assert b.checkpoint.uri == "s3://bucket/runs/job-b"
    assert b.training.output_dir == str((tmp_path / "runs" / "named").resolve())
    assert resolve_job_paths(b, "job-b", tmp_path / "runs").checkpoint.uri == b.checkpoint.uri  # idempotent
    claim_folder(tmp_path / "f", "job-a")
    claim_folder(tmp_path / "f", "job-a")  # the same job again (a restarted supervisor)
    assert folder_owner(tmp_path / "f") == "job-a" and (tmp_path / "f" / OWNER_MARKER).exists()


def test_a_job_never_writes_into_another_jobs_folder(head_cluster: Any, tmp_path: Path) -> None:
    claim_folder(tmp_path / "taken", "some-other-job")
    (tmp_path / "taken" / "metrics.jsonl").write_text('{"step": 1}\n')
    run = JobRun(tiny_spec(tmp_path / "taken", steps=2, dp=1))
    st = run.wait(timeout_s=180)
    run.finish()
    assert st["state"] == "FAILED" and "belongs to job some-other-job" in st["reason"], st
    assert (tmp_path / "taken" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


def test_resume_from_another_runs_checkpoints(head_cluster: Any, tmp_path: Path) -> None:
    first = JobRun(tiny_spec(tmp_path / "first", steps=8, dp=2, ckpt={"persist_every": 4}))
    assert first.wait()["state"] == "SUCCEEDED", first.events
    first.finish()
    folder = tmp_path / "first" / "checkpoints"
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    # From its step-4 checkpoint, at another dp: the same trajectory from step 5 on.
    step4 = (folder / "step-00000004").resolve().as_uri()
    second = JobRun(tiny_spec(tmp_path / "second", steps=8, dp=1, ckpt={"resume_from": step4}))
    st = second.wait()
    second.finish()
    assert st["state"] == "SUCCEEDED", second.events
    rows = second.rows()
    assert [r["step"] for r in rows] == [5, 6, 7, 8], rows
    ref = first.rows()
    assert_same_losses(ref[:4] + rows, ref)
    # Read only: the first run's checkpoints are as it left them.
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == before
