"""Held-out evaluation: a fixed set disjoint from training, the same on any dp degree, through the
metrics a run writes, and across a resume from a checkpoint written at another dp."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from api.cli import app
from parallel.config import DataConfig, EngineConfig
from parallel.data import DataLoader
from parallel.data.prepare import prepare_dataset
from parallel.data.tokenizer import load_tokenizer
from parallel.trainer import Trainer
from tests.data.local_tokenizer import corpus_texts, make_tokenizer
from tests.parallel.harness import launch


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Python sources as JSONL documents, prepared with a BPE tokenizer trained here."""
    d = tmp_path_factory.mktemp("eval")
    tok = make_tokenizer(d / "tok", vocab_size=320)
    lines = [line for text in corpus_texts() for line in text.split("\n\n") if line.strip()]
    with (d / "train.jsonl").open("w") as f:
        for doc in lines[: len(lines) * 9 // 10]:
            f.write(json.dumps({"text": doc}) + "\n")
    with (d / "heldout.jsonl").open("w") as f:
        for doc in lines[len(lines) * 9 // 10 :]:
            f.write(json.dumps({"text": doc}) + "\n")
    prepare_dataset(DataConfig(kind="jsonl", path=str(d / "train.jsonl")), d / "prepared", load_tokenizer(str(tok)))
    return {"dir": d, "tok": tok, "prepared": d / "prepared", "heldout": d / "heldout.jsonl"}


def test_split_is_fixed_and_never_trained_on(prepared: dict[str, Path]) -> None:
    cfg = DataConfig(kind="tokens", path=str(prepared["prepared"]), seed=5, eval={"split": 0.1, "sequences": 1000})
    dl = DataLoader(cfg, 32, 8, 320)
    assert dl.eval_set is not None
    held = set(dl.eval_set.windows.tolist())
    n = dl.source.n_windows
    assert n is not None and len(held) == round(0.1 * (n + len(held)))
    trained = {dl.source.window_id(i) for i in range(2 * n)}  # two epochs
    assert trained.isdisjoint(held) and len(trained) == n
    again = DataLoader(cfg, 32, 8, 320)
    assert again.eval_set is not None and np.array_equal(again.eval_set.windows, dl.eval_set.windows)
    other = DataLoader(cfg.model_copy(update={"seed": 6}), 32, 8, 320)
    assert other.eval_set is not None and not np.array_equal(other.eval_set.windows, dl.eval_set.windows)
    # Batches over dp ranks cover the eval set exactly once, whatever dp is.
    for dp in (1, 3, 4):
        rows = [b.inputs[(b.targets != -100).any(dim=1)] for r in range(dp) for m in dl.eval_batches(r, dp) for b in m]
        assert sum(len(x) for x in rows) == len(held)


def test_eval_set_of_its_own_uses_the_training_tokenizer(prepared: dict[str, Path]) -> None:
    cfg = DataConfig(kind="tokens", path=str(prepared["prepared"]),
                     eval={"kind": "jsonl", "path": str(prepared["heldout"]), "sequences": 3})
    dl = DataLoader(cfg, 32, 8, 320)
    assert dl.eval_set is not None and len(dl.eval_set) == 3
    first = json.loads(prepared["heldout"].read_text().splitlines()[0])["text"]
    ids = load_tokenizer(str(prepared["tok"])).encode_batch([first])[0]
    assert dl.eval_set.sample(0).tokens[:20].tolist() == ids[:20], "the prepared folder's tokenizer, not bytes"
    assert dl.eval_tokens() == 3 * 32


def test_eval_reaches_metrics_progress_and_tensorboard(prepared: dict[str, Path], tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from workers.metrics_log import read_metrics
    from workers.tensorboard import write_from_metrics_file

    job = {"model": {"preset": "tiny", "vocab_size": 320},
           "training": {"steps": 6, "seq_len": 32, "global_batch_size": 4, "eval_every": 3},
           "data": {"kind": "tokens", "path": str(prepared["prepared"]), "eval": {"split": 0.05, "sequences": 8}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    res = CliRunner().invoke(app, ["train", str(tmp_path / "job.yaml"), "--nproc", "2", "--output",
                                   str(tmp_path / "run"), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    rows = read_metrics(tmp_path / "run")
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evals) == [3, 6] and all(math.isfinite(v) for v in evals.values())
    assert all(abs(r["eval_ppl"] - math.exp(r["eval_loss"])) < 1e-6 * r["eval_ppl"] for r in rows if "eval_loss" in r)
    assert f"eval {evals[6]:.4f}" in res.output, "the progress lines show the eval loss"
    write_from_metrics_file(tmp_path / "run", tmp_path / "tb")
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("eval/loss")] == [(s, round(v, 4)) for s, v in
                                                                                sorted(evals.items())]


def test_resume_from_a_checkpoint_at_another_dp(prepared: dict[str, Path], tmp_path: Path) -> None:
    """3 ranks, then 2, each segment resuming from a DCP checkpoint written at the other dp: train and
    eval losses match the uninterrupted single-process run (<= 1e-4 fp32). (Shrinking and growing through
    the supervisor with in-memory snapshots: tests/data/test_elastic_job.py.)"""
    base: dict[str, Any] = {
        "model": {"preset": "tiny", "vocab_size": 320},
        "training": {"steps": 6, "seq_len": 32, "global_batch_size": 12, "eval_every": 2, "lr": 1e-3},
        "data": {"kind": "tokens", "path": str(prepared["prepared"]), "seed": 2, "document_mask": True,
                 "eval": {"kind": "jsonl", "path": str(prepared["heldout"]), "sequences": 10}},
    }
    trainer = Trainer(EngineConfig.model_validate(base), device=torch.device("cpu"))
    ref = [trainer.train_step() for _ in range(6)]
    got = launch("tests.data.rank_fns:elastic_with_eval", 3,
                 {"base": base, "segments": [(3, 3), (2, 6)], "dir": str(tmp_path)}, timeout_s=500)[0]
    assert len(got["losses"]) == 6
    assert max(abs(a - m.loss) for a, m in zip(got["losses"], ref, strict=True)) <= 1e-4
    want = {m.step: m.eval_loss for m in ref if m.eval_loss is not None}
    assert sorted(got["eval"]) == sorted(want) == [2, 4, 6]
    assert max(abs(got["eval"][s] - v) for s, v in want.items()) <= 1e-4
