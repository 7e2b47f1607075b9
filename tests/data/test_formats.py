"""Fine-tuning formats: prompt/completion and chat, with the loss on what the model should say.

The chat rendering equals transformers' apply_chat_template on the same tokenizer; the loss mask covers
exactly the assistant turns; the train step's loss is the mean over those tokens of the whole global batch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from parallel.config import DataConfig, EngineConfig
from parallel.data import IGNORE_INDEX, DataError, DataLoader
from parallel.data.corpus import open_prepared
from parallel.data.prepare import prepare_dataset
from parallel.data.tokenizer import load_tokenizer
from parallel.model import build_model, init_weights
from parallel.trainer import Trainer
from tests.data.local_tokenizer import make_tokenizer

CHATS = [
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "It is 6."}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}],
]
PAIRS = [{"prompt": f"Q{i}: what follows {i}?\nA:", "completion": f" {i + 1}"} for i in range(40)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _docs(prepared: Path) -> list[tuple[list[int], list[int]]]:
    c = open_prepared(str(prepared))
    assert c.doc_ends is not None and c.loss_mask is not None
    starts = [0, *c.doc_ends[:-1].tolist()]
    return [(c.tokens[a:b].tolist(), c.loss_mask[a:b].tolist()) for a, b in zip(starts, c.doc_ends.tolist(), strict=True)]


def test_chat_renders_as_transformers_and_masks_assistant_turns(tmp_path: Path, tok_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    src = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    tok = load_tokenizer(str(tok_dir))
    prepare_dataset(DataConfig(kind="jsonl", path=str(src), format="chat"), tmp_path / "out", tok)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    for (ids, mask), messages in zip(_docs(tmp_path / "out"), CHATS, strict=True):
        want = hf_tok.apply_chat_template(messages, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert ids[:-1] == list(want), "rendered and tokenized as transformers does"
        assert ids[-1] == tok.eos_id and mask[-1] == 0
        learned = tok.decode([t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
        answers = "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert learned == answers, "loss on each assistant turn and its end-of-turn marker, nothing else"


def test_prompt_completion_masks_the_prompt(tmp_path: Path, tok_dir: Path) -> None:
    src = _jsonl(tmp_path / "pc.jsonl", PAIRS)
    tok = load_tokenizer(str(tok_dir))
    prepare_dataset(DataConfig(kind="jsonl", path=str(src), format="prompt_completion"), tmp_path / "out", tok)
    for (ids, mask), pair in zip(_docs(tmp_path / "out"), PAIRS, strict=True):
        n_prompt = len(tok.encode_batch([pair["prompt"]])[0])
        assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
        assert tok.decode(ids[n_prompt:-1]) == pair["completion"] and ids[-1] == tok.eos_id
    # The loader turns unmasked targets into IGNORE_INDEX; the step's denominator counts the rest.
    dl = DataLoader(DataConfig(kind="tokens", path=str(tmp_path / "out"), document_mask=True), 32, 4, 512)
    batch = dl.global_batch(2)
    assert int((batch.targets != IGNORE_INDEX).sum()) == dl.loss_tokens(2) < 4 * 32


def test_train_step_loss_is_the_mean_over_completion_tokens(tmp_path: Path, tok_dir: Path) -> None:
    src = _jsonl(tmp_path / "pc.jsonl", PAIRS)
    cfg = EngineConfig.model_validate({
        "model": {"preset": "tiny", "vocab_size": 512}, "training": {"steps": 2, "seq_len": 32, "global_batch_size": 4},
        "data": {"kind": "jsonl", "path": str(src), "format": "prompt_completion", "tokenizer": str(tok_dir),
                 "document_mask": True},
    })
    model = build_model(cfg.model, device="cpu")
    init_weights(model, cfg.model)
    batch = DataLoader(cfg.data, 32, 4, 512).global_batch(0)
    with torch.no_grad():
        logits = model(batch.inputs, doc_ids=batch.doc_ids)
    want = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX).item()
    got = Trainer(cfg, device=torch.device("cpu")).train_step().loss
    assert abs(got - want) <= 1e-5


BAD = [
    ("chat", {"messages": "hello"}, "field 'messages' is str, not a list"),
    ("chat", {"messages": [{"role": "user"}]}, r"messages\[0\] is not \{role: str, content: str\}"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ("prompt_completion", {"prompt": "q"}, "missing field 'completion'"),
]


@pytest.mark.parametrize("fmt,row,message", BAD)
def test_bad_fine_tuning_rows_are_named(tmp_path: Path, tok_dir: Path, fmt: str, row: dict[str, Any],
                                        message: str) -> None:
    good = {"messages": CHATS[1]} if fmt == "chat" else PAIRS[0]
    src = _jsonl(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(DataError, match=f"d.jsonl:2: {message}"):
        prepare_dataset(DataConfig(kind="jsonl", path=str(src), format=fmt), tmp_path / "out",
                        load_tokenizer(str(tok_dir)))
    res = prepare_dataset(DataConfig(kind="jsonl", path=str(src), format=fmt, on_bad_row="skip"), tmp_path / "out",
                          load_tokenizer(str(tok_dir)))
    assert res.documents == 1 and res.skipped_rows == 1
