"""`unbroken plan`: tables, --explain, --json, exit codes, and no torch imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from api.cli import app

WIDE = {"COLUMNS": "250"}  # rich wraps at the terminal width

JOB = """
name: plan-test
model: {preset: llama3-8b, max_seq_len: 8192}
training: {seq_len: 8192, global_batch_size: 64, micro_batch_size: 1, dtype: bfloat16}
parallelism: {dp_shard: -1, tp: 2}
"""


def _job(tmp_path: Path, text: str = JOB) -> str:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return str(p)


def test_plan_lists_fitting_layouts_memory_and_rejections(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["plan", _job(tmp_path), "--gpus", "8", "--explain"], env=WIDE)
    assert res.exit_code == 0, res.output
    out = res.output
    assert "layouts that fit" in out and "memory per device of the best" in out
    assert "the job's own layout dp_shard=4 tp=2 fits" in out
    assert "rejected layouts" in out and "optimizer states need" in out
    assert "6 × 7.5e+09 + 12 × 32 × 32 × 128 × 8192" in out  # --explain fills in the formulas


def test_plan_json_is_what_the_api_returns(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["plan", _job(tmp_path), "--gpus", "16", "--gpu", "h200", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["ok"] and data["cluster"] == {**data["cluster"], "gpu": "h200", "gpus": 16, "nodes": 2}
    assert data["candidates"][0]["tokens_per_s"] >= data["candidates"][-1]["tokens_per_s"]


def test_plan_exit_codes(tmp_path: Path) -> None:
    runner = CliRunner()
    job70 = _job(tmp_path, "model: {preset: llama3-70b}\nparallelism: auto\ntraining: {dtype: bfloat16}\n")
    res = runner.invoke(app, ["plan", job70, "--gpus", "1"], env=WIDE)
    assert res.exit_code == 1 and "no layout fits" in res.output and "optimizer states need" in res.output
    res = runner.invoke(app, ["plan", _job(tmp_path), "--gpus", "6", "--nodes", "4"], env=WIDE)
    assert res.exit_code == 2 and "not divisible by nodes" in res.output
    res = runner.invoke(app, ["plan", str(tmp_path / "missing.yaml"), "--gpus", "8"], env=WIDE)
    assert res.exit_code == 2 and "does not exist" in res.output


def test_plan_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from api.cli import app;"
        f"r = CliRunner().invoke(app, ['plan', {_job(tmp_path)!r}, '--gpus', '8', '--json']);"
        "assert r.exit_code == 0, r.output;"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'heavy import';"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=120)
