"""Bad data sets and tokenizers, each refused before anything starts with a message naming the field and fix.

`check_data` is what submit runs; config mistakes are refused earlier still, by validation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from api.cli import app
from parallel.config import DataConfig, EngineConfig, format_validation_error
from parallel.data.check import check_data
from parallel.data.prepare import prepare_dataset
from parallel.data.tokenizer import load_tokenizer
from tests.data.local_tokenizer import make_tokenizer


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("check")
    w = {"tok": make_tokenizer(d / "tok"), "tok2": make_tokenizer(d / "tok2", vocab_size=300)}
    (d / "good.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(20)))
    (d / "nofield.jsonl").write_text('{"body": "x"}\n')
    (d / "empty").mkdir()
    (d / "empty" / "notes.txt").write_text("not jsonl")
    (d / "pq").mkdir()
    pq.write_table(pa.table({"body": ["a", "b"]}), d / "pq" / "0.parquet")
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(d / "hf"))
    (d / "notjson").mkdir()
    (d / "notjson" / "tokenizer.json").write_text("{ not json")
    (d / "noeos").mkdir()  # a tokenizer without any special token nor a config naming one
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.train_from_iterator(["plain text only"] * 10, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    t.save(str(d / "noeos" / "tokenizer.json"))
    np.arange(100, dtype=np.uint16).tofile(d / "flat.bin")
    prepare_dataset(DataConfig(kind="jsonl", path=str(d / "good.jsonl")), d / "prepared", load_tokenizer(str(w["tok"])))
    w.update({k: d / k for k in ("good.jsonl", "nofield.jsonl", "empty", "pq", "hf", "notjson", "noeos", "flat.bin",
                                   "prepared")})
    w["missing"] = d / "missing"
    return w


def _job(data: dict[str, Any], vocab: int = 512, seq_len: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": {"preset": "tiny", "vocab_size": vocab}, "data": data, "training": {"seq_len": seq_len}} | extra


# (name, job builder, expected message fragment)
CASES: list[tuple[str, Any, str]] = [
    ("missing path", lambda w: _job({"kind": "jsonl", "path": str(w["missing"])}),
     "data.path='{missing}' does not exist"),
    ("missing tokenizer", lambda w: _job({"kind": "jsonl", "path": str(w["good.jsonl"]), "tokenizer": str(w["missing"])}),
     "data.tokenizer='{missing}' does not exist; point it at a tokenizer.json"),
    ("folder without tokenizer.json", lambda w: _job({"kind": "jsonl", "path": str(w["good.jsonl"]),
                                                      "tokenizer": str(w["empty"])}),
     "has no tokenizer.json: only fast (tokenizers-library) tokenizers are read"),
    ("tokenizer not JSON", lambda w: _job({"kind": "jsonl", "path": str(w["good.jsonl"]), "tokenizer": str(w["notjson"])}),
     "tokenizer.json is not a tokenizers JSON file"),
    ("tokenizer without EOS", lambda w: _job({"kind": "jsonl", "path": str(w["good.jsonl"]), "tokenizer": str(w["noeos"])}),
     "names no end-of-document token"),
    ("unknown eos_token", lambda w: _job({"kind": "jsonl", "path": str(w["good.jsonl"]), "tokenizer": str(w["tok"]),
                                          "eos_token": "<nope>"}),
     "data.eos_token='<nope>' is not a token of"),
    ("vocab too large", lambda w: _job({"kind": "jsonl", "path": str(w["good.jsonl"]), "tokenizer": str(w["tok"])}, vocab=400),
     "has 512 ids but model.vocab_size=400; raise model.vocab_size to at least 512"),
    ("byte-level on a small model", lambda w: _job({"kind": "text", "path": str(w["good.jsonl"])}, vocab=128),
     "byte-level has 256 ids but model.vocab_size=128"),
    ("first row lacks the field", lambda w: _job({"kind": "jsonl", "path": str(w["nofield.jsonl"])}),
     "nofield.jsonl:1: missing field 'text'; fix the row, or skip such rows with data.on_bad_row: skip"),
    ("folder without jsonl", lambda w: _job({"kind": "jsonl", "path": str(w["empty"])}),
     "holds no data files (*.jsonl, *.json)"),
    ("parquet without the column", lambda w: _job({"kind": "parquet", "path": str(w["pq"])}),
     "has no column 'text' (columns: body); set data.text_field"),
    ("hf folder not from save_to_disk", lambda w: _job({"kind": "hf_dataset", "path": str(w["empty"])}),
     "has no state.json: it is not a folder written by datasets' save_to_disk"),
    ("document mask on a flat file", lambda w: _job({"kind": "tokens", "path": str(w["flat.bin"]), "document_mask": True}),
     "data.document_mask needs document boundaries"),
    ("prepared with another tokenizer", lambda w: _job({"kind": "tokens", "path": str(w["prepared"]),
                                                        "tokenizer": str(w["tok2"])}),
     "differs from the tokenizer"),
    ("prepared data shorter than a window", lambda w: _job({"kind": "tokens", "path": str(w["prepared"])}, seq_len=100_000),
     "fewer than training.seq_len+1=100001"),
    ("chat without a template", lambda w: _job({"kind": "jsonl", "path": str(w["good.jsonl"]), "format": "chat"}),
     "data.format=chat needs a chat template: byte-level has none"),
    ("eval set missing", lambda w: _job({"kind": "jsonl", "path": str(w["good.jsonl"]),
                                         "eval": {"path": str(w["missing"])}}),
     "data.eval.path='{missing}' does not exist"),
    ("eval_every without an eval set", lambda w: _job({"kind": "jsonl", "path": str(w["good.jsonl"])},
                                                       training={"seq_len": 16, "eval_every": 5}),
     "training.eval_every=5 but data.eval is not set"),
    ("eval tokenizer too large", lambda w: _job({"kind": "text", "path": str(w["good.jsonl"]),
                                                 "eval": {"path": str(w["good.jsonl"]), "tokenizer": str(w["tok"])}}, vocab=300),
     "data.eval.tokenizer: "),
]


@pytest.mark.parametrize("name,build,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_data_is_refused_with_its_field(world: dict[str, Path], name: str, build: Any, fragment: str) -> None:
    cfg = EngineConfig.model_validate(build(world))
    problems = check_data(cfg)
    expected = fragment.format(missing=world["missing"])
    assert any(expected in p for p in problems), f"{name}: {problems}"


def test_good_data_passes(world: dict[str, Path]) -> None:
    for data in ({"kind": "jsonl", "path": str(world["good.jsonl"]), "tokenizer": str(world["tok"]),
                  "eval": {"split": 0.1}},
                 {"kind": "tokens", "path": str(world["prepared"]), "document_mask": True,
                  "eval": {"path": str(world["good.jsonl"]), "kind": "jsonl"}},
                 {"kind": "hf_dataset", "path": str(world["hf"])}):
        assert check_data(EngineConfig.model_validate(_job(data))) == []


CONFIG_CASES = [
    ({"kind": "jsonl"}, "data: Value error, data.kind='jsonl' needs data.path"),
    ({"kind": "text", "path": "x", "format": "chat"}, "data.format=chat reads records"),
    ({"kind": "jsonl", "path": "x", "eval": {"split": 0.1, "path": "y"}}, "cannot be set with it"),
    ({"kind": "jsonl", "path": "x", "eval": {"split": 1.5}}, "data.eval.split: Input should be less than 1"),
    ({"kind": "jsonl", "path": "x", "eval": {}}, "data.eval needs a held-out set"),
    ({"document_mask": True}, "synthetic data has none"),
    ({"kind": "jsonl", "path": "x", "on_bad_row": "ignore"}, "data.on_bad_row: Input should be 'fail' or 'skip'"),
]


@pytest.mark.parametrize("data,fragment", CONFIG_CASES)
def test_bad_data_sections_fail_validation(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError) as err:
        EngineConfig.model_validate({"data": data})
    assert fragment.replace("Value error, ", "") in format_validation_error(err.value)


def test_cli_check_refuses_before_anything_starts(world: dict[str, Path], tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job({"kind": "jsonl", "path": str(world["good.jsonl"]), "tokenizer": str(world["tok"])},
                                       vocab=256)))
    res = CliRunner().invoke(app, ["data", "check", str(job)])
    assert res.exit_code == 2 and "raise model.vocab_size to at least 512" in res.output
    job.write_text(yaml.safe_dump(_job({"kind": "jsonl", "path": str(world["good.jsonl"]), "tokenizer": str(world["tok"])})))
    ok = CliRunner().invoke(app, ["data", "check", str(job)])
    assert ok.exit_code == 0 and "data OK" in ok.output
