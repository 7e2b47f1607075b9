"""Packed documents with document masks: attention stays inside each document, on every layout.

Single process: a packed, masked window gives each document the logits it has alone. Multi-rank:
one 4-rank launch trains FSDP, TP, CP (ring attention), PP and PP x CP on packed data with document
masks and a held-out split evaluated every 5 steps, and FSDP, TP, CP and PP fine-tune on
prompt/completion pairs (loss on completions only, normalised by the global count of completion
tokens, whatever dp is); each matches one process (train and eval losses <= 1e-5 fp32 over 10
steps, final weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from parallel.config import DataConfig, EngineConfig, ModelConfig
from parallel.data import DataLoader
from parallel.data.prepare import prepare_dataset
from parallel.data.tokenizer import load_tokenizer
from parallel.model import build_model, init_weights
from parallel.trainer import Trainer
from tests.parallel.harness import launch
from tests.parallel.layout_parity import check_parity

STEPS = 10
TRAIN: dict[str, Any] = {"steps": STEPS, "seq_len": 32, "global_batch_size": 8, "warmup_steps": 2, "lr": 1e-3,
                         "eval_every": 5}
LAYOUTS: list[dict[str, Any]] = [
    dict(name="fsdp4", world=4, parallelism={}),
    dict(name="tp2", world=4, parallelism={"tp": 2}),
    dict(name="cp2", world=4, parallelism={"cp": 2}),
    dict(name="pp2", world=4, parallelism={"pp": 2, "pp_microbatches": 4}),
    dict(name="pp2xcp2", world=4, parallelism={"pp": 2, "cp": 2, "pp_microbatches": 2}),
]


def corpus(folder: Path) -> Path:
    """JSONL of short documents (2..40 bytes: several per 32-token window), prepared byte-level."""
    import random

    rng = random.Random(0)
    words = ["the", "a", "of", "unbroken", "training", "data", "packed", "window", "document", "mask", "ring", "pipe"]
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "docs.jsonl").open("w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))}) + "\n")
    prepare_dataset(DataConfig(kind="jsonl", path=str(folder / "docs.jsonl")), folder / "prepared", load_tokenizer(None))
    return folder / "prepared"


SFT_LAYOUTS: list[dict[str, Any]] = [
    dict(name="sft-fsdp4", world=4, parallelism={}),
    dict(name="sft-tp2", world=4, parallelism={"tp": 2}),
    dict(name="sft-cp2", world=4, parallelism={"cp": 2}),
    dict(name="sft-pp2", world=4, parallelism={"pp": 2, "pp_microbatches": 2}),
]


def sft_corpus(folder: Path) -> Path:
    """Prompt/completion pairs, prepared byte-level with their loss mask."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "pairs.jsonl").open("w") as f:
        for i in range(300):
            f.write(json.dumps({"prompt": f"{i} plus {i % 7} is", "completion": f" {i + i % 7}."}) + "\n")
    prepare_dataset(DataConfig(kind="jsonl", path=str(folder / "pairs.jsonl"), format="prompt_completion"),
                    folder / "prepared", load_tokenizer(None))
    return folder / "prepared"


def sft_base(prepared: Path) -> dict[str, Any]:
    return {"model": {"preset": "tiny", "n_layers": 4}, "training": {**TRAIN, "eval_every": None},
            "data": {"kind": "tokens", "path": str(prepared), "document_mask": True, "seed": 4}}


def base(prepared: Path) -> dict[str, Any]:
    return {"model": {"preset": "tiny", "n_layers": 4}, "training": TRAIN,
            "data": {"kind": "tokens", "path": str(prepared), "document_mask": True, "seed": 1,
                     "eval": {"split": 0.05, "sequences": 12}}}


def test_masked_window_equals_each_document_alone(tmp_path: Path) -> None:
    prepared = corpus(tmp_path)
    dl = DataLoader(DataConfig(kind="tokens", path=str(prepared), document_mask=True), 32, 4, 256)
    batch = dl.global_batch(3)
    assert batch.doc_ids is not None and int(batch.doc_ids.max()) >= 2, "windows hold several documents"
    cfg = ModelConfig(preset="tiny")
    model = build_model(cfg, device="cpu")
    init_weights(model, cfg)
    with torch.no_grad():
        packed = model(batch.inputs, doc_ids=batch.doc_ids)
        plain = model(batch.inputs)
        for row in range(batch.inputs.shape[0]):
            ids = batch.doc_ids[row]
            for d in ids.unique():
                pos = torch.nonzero(ids == d).flatten()
                alone = model(batch.inputs[row : row + 1, pos])[0]  # the document by itself, from position 0
                torch.testing.assert_close(packed[row, pos], alone, atol=2e-5, rtol=0)
        first = batch.doc_ids[:, :] == 0
        assert torch.equal(packed[first], plain[first]), "the first document sees nothing else either way"
        assert (packed - plain).abs().max() > 1e-3, "later documents no longer see earlier ones"


def _reference(raw: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor], dict[int, float]]:
    trainer = Trainer(EngineConfig.model_validate(raw), device=torch.device("cpu"))
    metrics = [trainer.train_step() for _ in range(STEPS)]
    return ([m.loss for m in metrics], trainer.full_state_dict(),
            {m.step: m.eval_loss for m in metrics if m.eval_loss is not None})


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    root = tmp_path_factory.mktemp("packing")
    runs = [{"base": base(corpus(root / "pretrain")), "layouts": LAYOUTS},
            {"base": sft_base(sft_corpus(root / "sft")), "layouts": SFT_LAYOUTS}]
    got = launch("tests.data.rank_fns:train_layouts", 4, {"runs": runs}, timeout_s=600)[0]
    return got, {"pretrain": _reference(runs[0]["base"]), "sft": _reference(runs[1]["base"])}


@pytest.mark.parametrize("name", [lay["name"] for lay in LAYOUTS])
def test_document_masked_layouts_match_one_process(name: str, parity: tuple[dict[str, Any], Any]) -> None:
    got, refs = parity
    losses, weights, evals = refs["pretrain"]
    check_parity(got[name], (losses, weights), name)
    assert sorted(evals) == [5, 10] and sorted(got[name]["eval"]) == [5, 10]
    for step, value in evals.items():
        assert abs(got[name]["eval"][step] - value) <= 1e-5, f"{name}: eval loss at step {step}"


@pytest.mark.parametrize("name", [lay["name"] for lay in SFT_LAYOUTS])
def test_fine_tuning_layouts_match_one_process(name: str, parity: tuple[dict[str, Any], Any]) -> None:
    got, refs = parity
    losses, weights, _ = refs["sft"]
    check_parity(got[name], (losses, weights), name)
