"""The persistent tier in one process: round trip, retention, faults, fencing, the CLI.

Faults are real: SeaweedFS is SIGKILLed in the middle of a multipart upload, an object's bytes are
overwritten in the store, and a full disk is the kernel's ENOSPC from /dev/full.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from typer.testing import CliRunner

from api.cli import app
from checkpointing.catalog import list_checkpoints
from checkpointing.config import CheckpointConfig, S3Config
from checkpointing.local_s3 import LocalS3Server
from checkpointing.manifest import MANIFEST_NAME, step_dir
from checkpointing.persistent import CheckpointManager, CorruptCheckpoint
from checkpointing.state import capture_rng, flatten, gather_full, restore_rng
from checkpointing.uri import parse_uri
from parallel.config import ModelConfig
from parallel.model import build_model, init_weights

MODEL = ModelConfig(preset="tiny")


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(MODEL, "cpu")
    init_weights(model, MODEL, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 17), generator=g)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, **extra: Any) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step, "data": {"position": step * 2}, **extra}


def fresh_target(**extra: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, opt = make(seed=99)
    return model, opt, state_of(model, opt, -1, **extra)


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    fa, fb = flatten(gather_full(a)), flatten(gather_full(b))
    assert set(fa) == set(fb)
    for k in fa:
        if isinstance(fa[k], torch.Tensor):
            assert torch.equal(fa[k], fb[k]), k
        else:
            assert fa[k] == fb[k], k


def file_cfg(path: Path, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(uri=f"file://{path}", **kw)


def s3_cfg(server: LocalS3Server, bucket: str, prefix: str, **kw: Any) -> CheckpointConfig:
    s3 = kw.pop("s3", None) or server.s3_config(
        part_size_mb=5, max_concurrency=2, max_attempts=2, read_timeout_s=5
    )
    return CheckpointConfig(uri=f"s3://{bucket}/{prefix}", s3=s3, **kw)


def test_uri_parsing() -> None:
    assert parse_uri("s3://b/p/q/").prefix == "p/q"
    assert parse_uri("file:///tmp/x").path == "/tmp/x"
    assert parse_uri("rel/dir").path == os.path.abspath("rel/dir")
    for bad, words in (("s3://", "bucket"), ("gs://b/p", "unsupported scheme"), ("file://rel", "absolute"),
                       ("s3://key:secret@b/p", "no credentials")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            parse_uri(bad)


def test_file_round_trip_retention_rng_and_cli(tmp_path: Path) -> None:
    model, opt = make()
    mgr = CheckpointManager(file_cfg(tmp_path / "ck", keep_last=2), "unused", rank=0, world_size=1)
    torch.manual_seed(7)
    saved = None
    handles = []
    for step in range(1, 5):
        train(model, opt, step)
        state = state_of(model, opt, step, rng=capture_rng())
        if step == 4:
            saved = flatten(gather_full(state))
            expected_next = torch.rand(3)  # what the RNG gives right after the save
        # With optimizer=: the tensors are copied on the upload thread; opt.step() waits for that.
        handles.append(mgr.save_async(state, step, generation=0, layout={"dp_shard": 1}, optimizer=opt))
    loss5 = train(model, opt, 5)  # changes parameters and moments right away
    results = [h.result() for h in handles]
    assert all(r.ok for r in results), [r.error for r in results]
    assert all(h.staged.is_set() for h in handles)
    assert [i.step for i in mgr.list()] == [3, 4]  # retention: keep_last=2

    model2, opt2, target = fresh_target(rng=capture_rng())
    info = mgr.latest_valid()
    assert info is not None and info.step == 4 and info.verified and mgr.skipped == []
    mgr.load(target, info)
    set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert target["step"] == 4 and target["data"] == {"position": 8}
    got = flatten(gather_full(state_of(model2, opt2, 4, rng=target["rng"])))
    assert got.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(v, got[k]) if isinstance(v, torch.Tensor) else v == got[k], k
    restore_rng(target["rng"])
    assert torch.equal(torch.rand(3), expected_next)
    assert train(model2, opt2, 5) == loss5  # the step after the save, from the restored state
    mgr.close()

    runner = CliRunner()
    out = runner.invoke(app, ["checkpoints", "list", str(tmp_path / "ck")])
    assert out.exit_code == 0, out.output
    assert "dp_shard=1" in out.output and "yes" in out.output
    rows = json.loads(
        runner.invoke(app, ["checkpoints", "list", f"file://{tmp_path / 'ck'}", "--json"]).output
    )
    assert [(r["step"], r["valid"], r["generation"]) for r in rows] == [(3, True, 0), (4, True, 0)]
    out = runner.invoke(app, ["checkpoints", "verify", str(tmp_path / "ck")])
    assert out.exit_code == 0 and "step 4: OK" in out.output, out.output
    out = runner.invoke(app, ["checkpoints", "verify", str(tmp_path / "ck"), "--step", "9"])
    assert out.exit_code == 1 and "no checkpoint step-00000009" in out.output


def test_an_s3_client_is_made_once_per_process_and_settings() -> None:
    """A re-form builds its CheckpointManager again: it must reuse the process's client (a new boto3
    session and client cost 50-100 ms of CPU on the recovery path), never one made for other settings."""
    from checkpointing.storage_s3 import S3Store

    def store(**kw: Any) -> S3Store:
        cfg = {"endpoint_url": "http://127.0.0.1:9", "region": "us-east-1", "access_key_id": "k",
               "secret_access_key": "s", **kw}  # fmt: skip
        return S3Store("b", "job-1", S3Config(**cfg))

    first = store()
    assert store().client is first.client
    assert S3Store("other-bucket", "job-2", S3Config(endpoint_url="http://127.0.0.1:9", region="us-east-1",
                                                     access_key_id="k", secret_access_key="s")).client is first.client
    for other in ({"endpoint_url": "http://127.0.0.1:10"}, {"secret_access_key": "t"}, {"region": "eu-west-1"},
                  {"max_attempts": 2}, {"read_timeout_s": 5.0}, {"max_concurrency": 3}):  # fmt: skip
        assert store(**other).client is not first.client, other


def test_full_disk_is_reported_and_training_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    model, opt = make()
    mgr = CheckpointManager(file_cfg(root), "unused", rank=0, world_size=1)
    train(model, opt, 1)
    assert mgr.save(state_of(model, opt, 1), 1, 0, {}).ok
    # The rank's data object is written through `<name>.partial`: point that at /dev/full (ENOSPC).
    partial = root / step_dir(2) / "__0_0.distcp.partial"
    partial.parent.mkdir(parents=True)
    partial.symlink_to("/dev/full")
    train(model, opt, 2)
    handle = mgr.save_async(state_of(model, opt, 2), 2, 0, {})
    loss3 = train(model, opt, 3)  # the training loop is not disturbed
    res = handle.result()
    assert not res.ok
    assert "no space left" in res.error and str(partial.with_suffix("")) in res.error
    assert "free space" in res.error
    assert mgr.last_error == res.error
    assert math.isfinite(loss3) and mgr.latest_valid().step == 1
    assert not partial.exists() and not partial.is_symlink()  # the half-written temp file is gone
    assert mgr.save(state_of(model, opt, 3), 3, 0, {}).ok  # the next save succeeds
    assert mgr.latest_valid().step == 3
    mgr.close()


def test_store_killed_mid_upload_keeps_previous_and_next_save_succeeds(tmp_path: Path) -> None:
    server = LocalS3Server(tmp_path / "weed")
    try:
        server.start()
        server.create_bucket("killtest")
        cfg = s3_cfg(server, "killtest", "run")
        mgr = CheckpointManager(cfg, "unused", rank=0, world_size=1)
        model, opt = make()
        big = torch.randn(6 * 1024 * 1024)  # 24 MiB: several 5 MiB parts, so the kill lands mid-upload
        assert mgr.save(state_of(model, opt, 1, blob=big), 1, 0, {}).ok

        parts: list[int] = []

        def kill_after_first_part(**_: Any) -> None:
            parts.append(1)
            if len(parts) == 1:
                server.kill()

        mgr.store.client.meta.events.register("after-call.s3.UploadPart", kill_after_first_part)
        res = mgr.save(state_of(model, opt, 2, blob=big * 2), 2, 0, {})
        mgr.store.client.meta.events.unregister("after-call.s3.UploadPart", kill_after_first_part)
        assert not res.ok and "S3" in res.error and "__0_0.distcp" in res.error, res.error
        assert server.secret_key not in res.error

        server.start()  # same data folder and ports
        info = mgr.latest_valid()
        assert info is not None and info.step == 1, mgr.skipped
        assert mgr.save(state_of(model, opt, 3, blob=big * 3), 3, 0, {}).ok
        info = mgr.latest_valid()
        assert info.step == 3
        model2, opt2, target = fresh_target(blob=torch.zeros_like(big))
        mgr.load(target, info)
        assert torch.equal(target["blob"], big * 3)
        mgr.close()
    finally:
        server.stop()


def test_corrupt_object_is_skipped_with_reason(
    s3_server: LocalS3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    mgr = CheckpointManager(s3_cfg(s3_server, s3_bucket, "c"), "unused", rank=0, world_size=1)
    model, opt = make()
    for step in (1, 2):
        train(model, opt, step)
        assert mgr.save(state_of(model, opt, step), step, 0, {"dp": 1}).ok
    key = f"c/{step_dir(2)}/__0_0.distcp"
    raw = s3_server.client()
    data = bytearray(raw.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    raw.put_object(Bucket=s3_bucket, Key=key, Body=bytes(data))

    assert [i.valid for i in list_checkpoints(mgr.store)] == [True, True]  # the cheap check cannot see it
    info = mgr.latest_valid()
    assert info is not None and info.step == 1
    [(step, why)] = mgr.skipped
    assert step == 2 and "checksum mismatch" in why and key in why and "expected sha256" in why, why
    bad = next(i for i in mgr.list() if i.step == 2)
    with pytest.raises(CorruptCheckpoint, match="checksum mismatch"):
        mgr.load(fresh_target()[2], bad)
    # load_latest reads once and falls back from the corrupt step 2 to step 1.
    model1, opt1, target = fresh_target()
    assert mgr.load_latest(target).step == 1 and target["step"] == 1
    assert mgr.skipped[0][0] == 2 and "checksum mismatch" in mgr.skipped[0][1]
    mgr.close()

    # The CLI finds it too, with credentials from the standard chain (env) and --endpoint-url.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    runner = CliRunner()
    uri = f"s3://{s3_bucket}/c"
    out = runner.invoke(app, ["checkpoints", "verify", uri, "--endpoint-url", s3_server.endpoint_url])
    assert out.exit_code == 1 and "step 1: OK" in out.output and "checksum mismatch" in out.output, out.output
    out = runner.invoke(
        app, ["checkpoints", "verify", uri, "--step", "1", "--endpoint-url", s3_server.endpoint_url]
    )
    assert out.exit_code == 0, out.output
    out = runner.invoke(app, ["checkpoints", "list", uri, "--endpoint-url", s3_server.endpoint_url])
    assert out.exit_code == 0 and "dp=1" in out.output, out.output


def test_cli_module_imports_neither_torch_nor_ray(tmp_path: Path) -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from api.cli import app; "
        f"r = CliRunner().invoke(app, ['checkpoints', 'list', {str(tmp_path)!r}]); "
        "assert r.exit_code == 0, r.output; "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_incomplete_and_fenced_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    gen0 = CheckpointManager(file_cfg(root, keep_last=5), "unused", rank=0, world_size=1)
    model, opt = make()
    for step in (1, 2, 3):
        train(model, opt, step)
        assert gen0.save(state_of(model, opt, step), step, 0, {}).ok
    (root / step_dir(3) / MANIFEST_NAME).unlink()
    assert gen0.latest_valid().step == 2
    assert gen0.skipped == [(3, "incomplete: no manifest")]

    (root / step_dir(2) / MANIFEST_NAME).write_text("{not json")
    assert gen0.latest_valid().step == 1
    assert gen0.skipped[1][0] == 2 and "bad manifest" in gen0.skipped[1][1]
    assert gen0.save(state_of(model, opt, 2), 2, 0, {}).ok  # rewrite step 2 properly

    # Generation 1 resumed from step 1: generation 0's step 2 belongs to an abandoned timeline.
    gen1 = CheckpointManager(file_cfg(root, keep_last=5), "unused", rank=0, world_size=1)
    gen1.fence(generation=1, resume_step=1)
    assert gen1.latest_valid().step == 1
    assert any(s == 2 and "fenced: generation 1 resumed from step 1" in why for s, why in gen1.skipped)
    # A stale generation-0 worker may not commit any more.
    res = gen0.save(state_of(model, opt, 4), 4, 0, {})
    assert not res.ok and "fenced" in res.error
    assert 4 not in [i.step for i in gen1.list() if i.valid]
    assert gen1.save(state_of(model, opt, 2), 2, 1, {}).ok
    info = gen1.latest_valid()
    assert (info.step, info.generation) == (2, 1)
    assert gen1.max_generation() == 1
    with pytest.raises(ValueError, match="JSON-serializable"):
        gen1.save_async(state_of(model, opt, 5), 5, 1, {"mesh": object()})
    with pytest.raises(ValueError, match=">= 0"):
        gen1.save_async(state_of(model, opt, 5), -1, 1, {})
    gen0.abandon()  # the stale generation lets go without waiting
    gen1.close()


def test_a_save_a_failure_broke_is_cleaned_up_once_a_newer_one_completes(tmp_path: Path) -> None:
    """A save broken by a fault never completes: once a newer checkpoint is complete, its folder goes
    (with keep_last not yet reached), and an incomplete folder newer than every complete one stays."""
    root = tmp_path / "ck"
    mgr = CheckpointManager(file_cfg(root, keep_last=5), "unused", rank=0, world_size=1)
    model, opt = make()
    for step in (1, 2):
        train(model, opt, step)
        assert mgr.save(state_of(model, opt, step), step, 0, {}).ok
    (root / step_dir(2) / MANIFEST_NAME).unlink()  # step 2's save was cut short
    (root / step_dir(9)).mkdir()  # a save still being written, newer than any complete one
    (root / step_dir(9) / "__0_0.distcp").write_bytes(b"half")
    train(model, opt, 3)
    assert mgr.save(state_of(model, opt, 3), 3, 0, {}).ok
    assert [(i.step, i.valid) for i in mgr.list()] == [(1, True), (3, True), (9, False)]
    mgr.close()


def test_secrets_stay_out_of_errors_and_logs(
    s3_server: LocalS3Server, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "WRONGsecret" + "x" * 20
    s3 = S3Config(endpoint_url=s3_server.endpoint_url, region="us-east-1", access_key_id=s3_server.access_key,
                  secret_access_key=wrong, max_attempts=1)  # fmt: skip
    mgr = CheckpointManager(s3_cfg(s3_server, s3_bucket, "s", s3=s3), "unused", rank=0, world_size=1)
    model, opt = make()
    with caplog.at_level(logging.DEBUG, logger="unbroken"):
        res = mgr.save(state_of(model, opt, 1), 1, 0, {})
    assert not res.ok and "SignatureDoesNotMatch" in res.error and "secret key is wrong" in res.error
    assert wrong not in res.error and wrong not in caplog.text and wrong not in repr(mgr.store)
    assert wrong not in repr(s3)
    mgr.close()
