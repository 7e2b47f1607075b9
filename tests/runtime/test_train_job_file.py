"""`unbroken train` takes the same job file as `unbroken run` and `unbroken submit`: the sections only
the service uses (name, priority, fault_tolerance, ...) are checked, not refused, and named as unused."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from api.cli import app
from tests.runtime.jobs import TINY_MODEL


def _job(tmp_path: Path, **extra: object) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "readme-example", "priority": 1, "model": TINY_MODEL,
        "training": {"steps": 2, "seq_len": 16, "global_batch_size": 2},
        "fault_tolerance": {"max_recoveries": 2}, **extra,
    }))
    return job


def test_train_runs_a_service_job_file_and_names_the_sections_it_does_not_use(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(_job(tmp_path)), "--nproc", "1", "--output", str(out),
                                      "--device", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "does not use the section(s) fault_tolerance, name, priority" in result.output, result.output
    assert "done: 2 steps" in result.output and (out / "metrics.jsonl").is_file()


def test_train_refuses_what_run_refuses_in_the_service_sections(tmp_path: Path) -> None:
    job = _job(tmp_path, fault_tolerance={"max_recoveries": -1})
    result = CliRunner().invoke(app, ["train", str(job), "--no-progress", "--output", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "fault_tolerance.max_recoveries" in result.output and "nothing started" in result.output
