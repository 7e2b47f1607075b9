"""`unbroken train` refuses bad job files before any process starts; `export-hf` refuses bad sources."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from api.cli import app

# (case, job file sections, --nproc, expected message fragments)
BAD_JOBS = [
    ("unknown field", {"model": {"preset": "tiny", "dimm": 64}}, 1, ["model.dimm", "Extra inputs are not permitted"]),
    ("tp does not divide heads", {"model": {"preset": "tiny"}, "parallelism": {"tp": 3}}, 3,
     ["parallelism (world size 3)", "tp=3 does not divide n_heads=4"]),
    ("negative steps", {"training": {"steps": -5}}, 1, ["training.steps", "greater than or equal to 1"]),
    ("missing data.path", {"data": {"kind": "text"}}, 1, ["data.kind='text' needs data.path"]),
    ("absent data.path", {"data": {"kind": "text", "path": "/no/such/corpus"}}, 1,
     ["data.path", "'/no/such/corpus' does not exist"]),
    ("sizes do not fill the world", {"parallelism": {"tp": 2, "dp_shard": 2}}, 3,
     ["parallelism (world size 3)", "world_size=3"]),
    ("batch smaller than dp", {"training": {"global_batch_size": 2}}, 4, ["global_batch_size=2", "dp=4"]),
    ("init_from not a model folder", {"model": {"init_from": "/no/such/model"}}, 1, ["model.init_from"]),
    ("no processes", {}, 0, ["--nproc=0"]),
]


@pytest.mark.parametrize("case,sections,nproc,expected", BAD_JOBS, ids=[c[0] for c in BAD_JOBS])
def test_bad_job_is_refused_before_start(
    case: str, sections: dict, nproc: int, expected: list[str], tmp_path: Path
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(sections))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(job), "--nproc", str(nproc), "--output", str(out),
                                      "--device", "cpu", "--no-progress"])
    assert result.exit_code == 2, result.output
    for fragment in expected:
        assert fragment in result.output, (fragment, result.output)
    assert "nothing started" in result.output
    assert not out.exists(), "the launcher created the run folder, so it got as far as starting"


def test_missing_job_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train", str(tmp_path / "nope.yaml"), "--no-progress"])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_export_hf_refuses_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["export-hf", str(tmp_path / "empty"), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "is not a finished run" in result.output
    assert not (tmp_path / "out").exists()
