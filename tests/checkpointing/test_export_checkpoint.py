"""`unbroken export-hf` from persistent checkpoints (file://, plain paths, S3), at any saved layout.

One 2-rank launch writes real checkpoints at steps 2 and 3 of four layouts (FSDP 2 to a run's
checkpoints/ folder, TP 2 to SeaweedFS S3, PP 2 and MoE EP 2 to file://). The exported folder,
read back by our HF loaders, must equal `Trainer.full_state_dict()` at that step, and
transformers must give our model's logits. Bad sources exit 2 with the problem and the fix.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from api.cli import app
from checkpointing.catalog import list_checkpoints
from checkpointing.local_s3 import LocalS3Server
from checkpointing.manifest import MANIFEST_NAME, data_file_name, step_dir
from checkpointing.storage_file import FileStore
from parallel.config import ModelConfig
from parallel.hf import load_hf_state_dict
from parallel.hf_mixtral import load_mixtral_state_dict
from parallel.model import build_model
from tests.parallel.harness import launch

TINY = {"preset": "tiny"}
BUCKET = "export-hf"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, s3_server: LocalS3Server) -> dict[str, Any]:
    """Checkpoints of every layout, and each layout's full state at each saved step."""
    base = tmp_path_factory.mktemp("export")
    s3_server.create_bucket(BUCKET)
    s3 = {"endpoint_url": s3_server.endpoint_url, "region": "us-east-1", "access_key_id": s3_server.access_key,
          "secret_access_key": s3_server.secret_key, "part_size_mb": 5, "max_concurrency": 2}  # fmt: skip
    layouts = [
        # Where a service run keeps them by default: a run folder's checkpoints/.
        {"name": "fsdp2", "world": 2, "model": TINY, "parallelism": {"dp_shard": 2},
         "uri": f"file://{base / 'run' / 'checkpoints'}"},
        {"name": "tp2", "world": 2, "model": {**TINY, "tie_embeddings": True}, "parallelism": {"tp": 2},
         "uri": f"s3://{BUCKET}/jobs/tp2", "s3": s3},
        {"name": "pp2", "world": 2, "model": TINY,
         "parallelism": {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 2}, "uri": f"file://{base / 'pp2'}"},
        {"name": "moe-ep2", "world": 2, "model": {"preset": "mixtral-tiny"}, "parallelism": {"ep": 2},
         "uri": f"file://{base / 'moe'}"},
    ]  # fmt: skip
    fulls = launch("tests.checkpointing.export_ranks:save_layouts", 2, {"layouts": layouts})[0]
    return {"base": base, "layouts": {lay["name"]: lay for lay in layouts}, "fulls": fulls, "server": s3_server}


@pytest.fixture
def s3_env(saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Credentials the way a user gives them to the CLI: boto3's standard environment."""
    server: LocalS3Server = saved["server"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    yield server.endpoint_url


def export(*args: str) -> Any:
    result = CliRunner().invoke(app, ["export-hf", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def exported_state(out: Path, moe: bool) -> dict[str, torch.Tensor]:
    state, _ = (load_mixtral_state_dict if moe else load_hf_state_dict)(str(out))
    return state


def assert_equal_state(got: dict[str, torch.Tensor], full: dict[str, torch.Tensor], tied: bool) -> None:
    expected = {k: v for k, v in full.items() if not (tied and k == "output.weight")}  # HF ties the head
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def source_of(saved: dict[str, Any], name: str) -> str:
    return saved["layouts"][name]["uri"]


@pytest.mark.parametrize("name", ["fsdp2", "tp2", "pp2", "moe-ep2"])
def test_newest_checkpoint_exports_the_full_state(saved: dict[str, Any], s3_env: str, name: str, tmp_path: Path) -> None:
    lay = saved["layouts"][name]
    out = tmp_path / "hf"
    args = [source_of(saved, name), str(out)] + (["--endpoint-url", s3_env, "--region", "us-east-1"]
                                                   if lay.get("s3") else [])  # fmt: skip
    result = export(*args)
    assert result.exit_code == 0, result.output
    assert "(step 3, generation 0)" in result.output
    moe = "moe" in name
    assert ("MixtralForCausalLM" if moe else "LlamaForCausalLM") in result.output
    tied = bool(lay["model"].get("tie_embeddings"))
    assert_equal_state(exported_state(out, moe), saved["fulls"][name][3], tied)


def test_logits_match_transformers(saved: dict[str, Any], s3_env: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    result = export(source_of(saved, "tp2"), str(out), "--endpoint-url", s3_env, "--step", "2")
    assert result.exit_code == 0, result.output
    cfg = ModelConfig.model_validate(saved["layouts"]["tp2"]["model"])
    ours = build_model(cfg, device="cpu")
    ours.load_state_dict(saved["fulls"]["tp2"][2])
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens).logits, ours.eval()(tokens), atol=1e-5, rtol=1e-4)


def test_step_choices(saved: dict[str, Any], tmp_path: Path) -> None:
    full2 = saved["fulls"]["fsdp2"][2]
    run = saved["base"] / "run"
    root = run / "checkpoints"
    # --step with a plain root, a step folder as the source (file:// and plain), a run folder with --step.
    for i, args in enumerate([[str(root), "--step", "2"], [f"file://{root}/{step_dir(2)}"],
                              [str(root / step_dir(2)), "--step", "2"], [str(run), "--step", "2"]]):  # fmt: skip
        out = tmp_path / f"hf{i}"
        result = export(args[0], str(out), *args[1:])
        assert result.exit_code == 0, (args, result.output)
        assert "(step 2, generation 0)" in result.output, result.output
        assert_equal_state(exported_state(out, moe=False), full2, tied=False)
    # A run folder without final/ state (the run did not finish): its newest checkpoint.
    result = export(str(run), str(tmp_path / "newest"))
    assert result.exit_code == 0 and "(step 3, generation 0)" in result.output, result.output


def _copy_root(saved: dict[str, Any], tmp_path: Path) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(saved["base"] / "run" / "checkpoints", copy)
    return copy


def _drop_config(root: Path, step: int) -> None:
    """Make the manifest what checkpoints written before the config was recorded have."""
    path = root / step_dir(step) / MANIFEST_NAME
    d = json.loads(path.read_text())
    del d["config"]
    path.write_text(json.dumps(d))


def test_checkpoint_without_config_needs_model_config(saved: dict[str, Any], tmp_path: Path) -> None:
    root = _copy_root(saved, tmp_path)
    for step in (2, 3):
        _drop_config(root, step)
    infos = list_checkpoints(FileStore(root))  # old manifests still list as valid
    assert [(i.step, i.valid, i.manifest and i.manifest.config) for i in infos] == [(2, True, None), (3, True, None)]

    result = export(str(root), str(tmp_path / "a"))
    assert result.exit_code == 2
    assert "does not record its model config" in result.output and "--model-config" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "a").exists()

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": TINY, "training": {"steps": 3}, "resources": {"dp": {"min": 1}}}))
    result = export(str(root), str(tmp_path / "b"), "--model-config", str(job))
    assert result.exit_code == 0, result.output
    assert_equal_state(exported_state(tmp_path / "b", moe=False), saved["fulls"]["fsdp2"][3], tied=False)

    # A model config that is not the checkpoint's model: the shapes say so.
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({"model": {**TINY, "n_layers": 3}}))
    result = export(str(root), str(tmp_path / "c"), "--model-config", str(wrong))
    assert result.exit_code == 2
    assert "does not fit the model config" in result.output and "layers.2" in result.output
    result = export(str(root), str(tmp_path / "c"), "--model-config", str(tmp_path / "none.yaml"))
    assert result.exit_code == 2 and "does not exist" in result.output


def test_model_config_must_agree_with_the_recorded_one(saved: dict[str, Any], tmp_path: Path) -> None:
    wrong = tmp_path / "job.yaml"
    wrong.write_text(yaml.safe_dump({"model": {**TINY, "rope_theta": 500000.0}}))
    result = export(source_of(saved, "pp2"), str(tmp_path / "out"), "--model-config", str(wrong))
    assert result.exit_code == 2
    assert "contradicts" in result.output and "rope_theta" in result.output


def test_corrupt_newest_is_skipped_unless_asked_for(saved: dict[str, Any], tmp_path: Path) -> None:
    root = _copy_root(saved, tmp_path)
    data = root / step_dir(3) / data_file_name(1)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the checksum can tell
    data.write_bytes(bytes(raw))
    result = export(str(root), str(tmp_path / "a"))
    assert result.exit_code == 0, result.output
    assert "(step 2, generation 0)" in result.output and "skipped step 3" in result.output
    assert_equal_state(exported_state(tmp_path / "a", moe=False), saved["fulls"]["fsdp2"][2], tied=False)
    result = export(str(root), str(tmp_path / "b"), "--step", "3")
    assert result.exit_code == 2
    assert "is corrupt" in result.output and "checksum" in result.output.lower()


def test_bad_sources_exit_2_with_the_problem(saved: dict[str, Any], s3_env: str, tmp_path: Path) -> None:
    root = saved["base"] / "run" / "checkpoints"
    incomplete = tmp_path / "incomplete"
    shutil.copytree(root / step_dir(2), incomplete / step_dir(2))
    (incomplete / step_dir(2) / MANIFEST_NAME).unlink()
    (tmp_path / "empty").mkdir()
    cases = [
        ([f"file://{tmp_path}/nope"], "does not exist"),
        ([str(tmp_path / "nope")], "does not exist"),
        ([str(tmp_path / "nope"), "--step", "2"], "does not exist"),
        ([str(tmp_path / "empty"), "--step", "2"], "holds no checkpoints"),
        ([f"file://{tmp_path}/empty"], "no checkpoints under"),
        ([str(incomplete)], "no valid checkpoint"),
        ([str(root), "--step", "7"], "no checkpoint for step 7"),
        ([f"file://{root}/{step_dir(2)}", "--step", "3"], "names step 2 but --step is 3"),
        ([f"s3://{BUCKET}/no/such/prefix", "--endpoint-url", s3_env], "no checkpoints under s3://"),
        (["gs://bucket/x"], "unsupported scheme"),
    ]
    for args, fragment in cases:
        out = tmp_path / "out"
        result = export(args[0], str(out), *args[1:])
        assert result.exit_code == 2, (args, result.output)
        assert fragment in result.output, (args, fragment, result.output)
        assert "Traceback" not in result.output
        assert not out.exists(), args
