"""The local launcher: a 2-process FSDP run matches one process, writes metrics.jsonl and a final
state that exports to Hugging Face; a failing or killed rank stops the run and is named.

Each launch costs ~7-25 s on 2 cores, so the first test checks many things from one launch.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from api.cli import app
from parallel.config import EngineConfig
from parallel.hf import export_hf
from parallel.model import build_model, init_weights
from parallel.trainer import Trainer
from workers.final_state import load_final_state
from workers.launcher import LocalLauncher, RankFailure
from workers.metrics_log import FIELDS, read_metrics

STEPS = 4


def _job(**model: Any) -> EngineConfig:
    return EngineConfig.model_validate({
        "model": {"preset": "tiny", **model},
        "training": {"steps": STEPS, "seq_len": 32, "global_batch_size": 4, "warmup_steps": 1},
        "parallelism": {"dp_shard": -1},
    })


def _hf_start(tmp_path: Path) -> Path:
    """A Hugging Face folder whose weights differ from the job's own seeded init."""
    cfg = _job(init_seed=123).model
    model = build_model(cfg, device="cpu")
    init_weights(model, cfg)
    export_hf(dict(model.state_dict()), cfg, str(tmp_path / "hf_start"))
    return tmp_path / "hf_start"


def test_fsdp2_run_matches_one_process_and_exports(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    start = _hf_start(tmp_path)
    job = _job(init_from=str(start))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job.model_dump(mode="json")))
    run_dir = tmp_path / "run"

    result = CliRunner().invoke(app, ["train", str(job_file), "--nproc", "2", "--output", str(run_dir),
                                      "--device", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "metrics:" in result.output

    # metrics.jsonl: one line per step, every field, the 2-rank layout.
    lines = read_metrics(run_dir)
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    for line in lines:
        assert set(FIELDS) <= line.keys()
        assert (line["dp"], line["world_size"], line["generation"]) == (2, 2, 0)
        assert line["tokens"] == 4 * 32 and line["tokens_per_s"] > 0

    # The same job in this process (world 1): init_from gives exactly the exported weights,
    # and the 2-rank sharded run follows the same losses and ends at the same weights.
    ref = Trainer(job, device=torch.device("cpu"))
    start_state = ref.full_state_dict()
    from safetensors.torch import load_file

    from parallel.hf import to_hf_name

    exported = load_file(str(start / "model.safetensors"))
    for name, t in start_state.items():
        assert torch.equal(t, exported[to_hf_name(name)]), name
    ref_losses = [ref.train_step().loss for _ in range(STEPS)]
    assert [line["loss"] for line in lines] == pytest.approx(ref_losses, abs=1e-5)
    fresh = Trainer(_job(), device=torch.device("cpu")).train_step().loss
    assert abs(fresh - ref_losses[0]) > 1e-3, "init_from made no difference to the first loss"

    final_state, final_cfg = load_final_state(run_dir / "final")
    assert final_cfg.model == job.model
    ref_final = ref.full_state_dict()
    assert final_state.keys() == ref_final.keys()
    for name, t in ref_final.items():
        torch.testing.assert_close(final_state[name], t, atol=1e-5, rtol=0, msg=name)

    # export-hf of the run folder loads in transformers and gives our model's logits.
    hf_dir = tmp_path / "hf_final"
    result = CliRunner().invoke(app, ["export-hf", str(run_dir), str(hf_dir)])
    assert result.exit_code == 0, result.output
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ours = build_model(job.model, device="cpu")
    ours.load_state_dict(final_state)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours.eval()(tokens) - hf(input_ids=tokens).logits).abs().max().item() <= 1e-5


def test_failing_rank_is_named_and_the_run_exits_nonzero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(_job().model_dump(mode="json")))
    monkeypatch.setenv("UNBROKEN_FAIL_AT", "1:3")  # rank 1 raises before step 3
    result = CliRunner().invoke(app, ["train", str(job_file), "--nproc", "2", "--output", str(tmp_path / "run"),
                                      "--device", "cpu", "--no-progress"])
    assert result.exit_code == 1, result.output
    assert "rank 1 failed first" in result.output
    assert "injected fault" in result.output  # from the rank's own error and its stderr tail
    assert "rank 1 stderr" in result.output
    # Steps completed before the fault are kept.
    assert [line["step"] for line in read_metrics(tmp_path / "run")] == [1, 2]
    assert not (tmp_path / "run" / "final").exists()


def test_killed_rank_stops_the_others(tmp_path: Path) -> None:
    def kill_rank1_after_step1(launcher: LocalLauncher, event: dict[str, Any]) -> None:
        if event["event"] == "step" and event["step"] == 1:
            os.kill(launcher.pids[1], signal.SIGKILL)

    launcher = LocalLauncher(_job(), 2, tmp_path / "run", device="cpu", show_progress=False,
                             on_event=kill_rank1_after_step1)
    with pytest.raises(RankFailure) as info:
        launcher.run()
    err = info.value
    assert (err.rank, err.returncode) == (1, -signal.SIGKILL)
    assert "rank 1 failed first: it was killed by SIGKILL" in str(err)
    assert 0 in err.others
    for proc in launcher.procs:
        assert proc.poll() is not None, f"pid {proc.pid} still runs"
    assert [line["step"] for line in read_metrics(tmp_path / "run")][:1] == [1]
