"""Tokenizers, raw data readers (JSONL, Parquet, `datasets` folders, text) and `unbroken data prepare`.

Every source goes through the same tokenization: the prepared folder and a job on the raw files give
the same token stream, equal to the tokenizer's own encoding with EOS after each document.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from api.cli import app
from parallel.config import DataConfig
from parallel.data import DataError, DataLoader
from parallel.data.corpus import open_prepared
from parallel.data.prepare import prepare_dataset
from parallel.data.tokenizer import load_tokenizer
from tests.data.local_tokenizer import make_tokenizer

DOCS = [f"document {i}: " + "the quick brown fox jumps. " * (i % 7 + 1) + "héllo ünïcode" for i in range(60)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def _expected(tok_path: str, docs: list[str]) -> np.ndarray:
    tok = load_tokenizer(tok_path)
    ids = [x + [tok.eos_id] for x in tok.encode_batch(docs)]
    return np.concatenate([np.array(x) for x in ids])


def _write_jsonl(path: Path, docs: list[str], field: str = "text") -> None:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")


def _prepare(src: DataConfig, out: Path, tok: str | None) -> tuple[np.ndarray, np.ndarray]:
    res = prepare_dataset(src, out, load_tokenizer(tok))
    corpus = open_prepared(str(out))
    assert res.tokens == corpus.n_tokens and res.documents == corpus.n_docs
    assert corpus.doc_ends is not None
    return np.asarray(corpus.tokens), np.asarray(corpus.doc_ends)


def test_every_source_kind_gives_the_tokenizers_own_ids(tmp_path: Path, tok_dir: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = _expected(str(tok_dir), DOCS)
    # JSONL: one file, and a folder of files (sorted by name) with a custom field.
    _write_jsonl(tmp_path / "one.jsonl", DOCS)
    (tmp_path / "many").mkdir()
    _write_jsonl(tmp_path / "many" / "a.jsonl", DOCS[:25], "body")
    _write_jsonl(tmp_path / "many" / "b.jsonl", DOCS[25:], "body")
    # Parquet, two files; a datasets DatasetDict written by save_to_disk (read without datasets).
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": DOCS[:30]}), tmp_path / "pq" / "0.parquet")
    pq.write_table(pa.table({"text": DOCS[30:]}), tmp_path / "pq" / "1.parquet")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": DOCS}),
        "test": datasets.Dataset.from_dict({"text": DOCS[:3]}),
    }).save_to_disk(str(tmp_path / "hf"))
    sources = {
        "jsonl": DataConfig(kind="jsonl", path=str(tmp_path / "one.jsonl")),
        "jsonl-folder": DataConfig(kind="jsonl", path=str(tmp_path / "many"), text_field="body"),
        "parquet": DataConfig(kind="parquet", path=str(tmp_path / "pq")),
        "hf_dataset": DataConfig(kind="hf_dataset", path=str(tmp_path / "hf"), hf_split="train"),
    }
    for name, src in sources.items():
        tokens, ends = _prepare(src, tmp_path / f"out-{name}", str(tok_dir))
        assert np.array_equal(tokens, expected), name
        assert len(ends) == len(DOCS) and ends[-1] == len(tokens), name
        assert (tokens[ends - 1] == load_tokenizer(str(tok_dir)).eos_id).all(), name
    meta = json.loads((tmp_path / "out-jsonl" / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["documents"] == len(DOCS) and meta["vocab_size"] == 512
    # The tokenizer travels with the data, and loads to the same fingerprint.
    carried = load_tokenizer(str(tmp_path / "out-jsonl" / "tokenizer"))
    assert carried.fingerprint == load_tokenizer(str(tok_dir)).fingerprint
    # Text files: each file one document; byte-level by default (ids are the bytes, EOS is 0).
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS[:3]):
        (tmp_path / "txt" / f"{i}.txt").write_text(d, encoding="utf-8")
    tokens, _ = _prepare(DataConfig(kind="text", path=str(tmp_path / "txt")), tmp_path / "out-txt", None)
    assert bytes(tokens.astype(np.uint8)) == b"".join(d.encode() + b"\0" for d in DOCS[:3])


def test_a_job_on_raw_data_sees_the_prepared_windows(tmp_path: Path, tok_dir: Path) -> None:
    _write_jsonl(tmp_path / "d.jsonl", DOCS)
    prepare_dataset(DataConfig(kind="jsonl", path=str(tmp_path / "d.jsonl")), tmp_path / "out",
                    load_tokenizer(str(tok_dir)))
    raw = DataLoader(DataConfig(kind="jsonl", path=str(tmp_path / "d.jsonl"), tokenizer=str(tok_dir), seed=3),
                     32, 4, 512)
    prepared = DataLoader(DataConfig(kind="tokens", path=str(tmp_path / "out"), seed=3), 32, 4, 512)
    for step in (0, 5, 40):  # 40 runs into the second epoch
        assert torch.equal(raw.global_batch(step).inputs, prepared.global_batch(step).inputs)
    # A tokenizer larger than the model is refused, naming both sizes and the fix.
    with pytest.raises(DataError, match=r"has 512 ids but model.vocab_size=300; raise model.vocab_size to at least 512"):
        DataLoader(DataConfig(kind="tokens", path=str(tmp_path / "out")), 32, 4, 300)
    # A different tokenizer than the one the folder was prepared with is refused.
    other = make_tokenizer(tmp_path / "tok2", vocab_size=400)
    with pytest.raises(DataError, match="differs from the tokenizer"):
        DataLoader(DataConfig(kind="tokens", path=str(tmp_path / "out"), tokenizer=str(other)), 32, 4, 512)


BAD_ROWS = [
    ("not UTF-8", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "d.jsonl:2: not UTF-8"),
    ("not JSON", b'{"text": "ok"}\n{"text": "half\n', "d.jsonl:2: not JSON"),
    ("missing field", b'{"text": "ok"}\n\n{"body": "x"}\n', "d.jsonl:3: missing field 'text'"),
    ("wrong type", b'{"text": "ok"}\n{"text": 7}\n', "d.jsonl:2: field 'text' is int, not a string"),
    ("not an object", b'{"text": "ok"}\n["text"]\n', "d.jsonl:2: a row is a JSON object, got list"),
]


@pytest.mark.parametrize("name,content,where", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_rows_name_file_and_line_and_leave_nothing(tmp_path: Path, name: str, content: bytes, where: str) -> None:
    (tmp_path / "d.jsonl").write_bytes(content + b'{"text": "last"}\n')
    src = DataConfig(kind="jsonl", path=str(tmp_path / "d.jsonl"))
    with pytest.raises(DataError, match=f"bad row at .*{where}.*--on-bad-row skip"):
        prepare_dataset(src, tmp_path / "out", load_tokenizer(None))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"], "nothing half-written is left"
    res = prepare_dataset(src.model_copy(update={"on_bad_row": "skip"}), tmp_path / "out", load_tokenizer(None))
    assert res.skipped_rows == 1 and where in res.skipped_examples[0] and res.documents == 2
    # A job on the raw file says the same, naming the setting.
    with pytest.raises(DataError, match=f"{where}.*data.on_bad_row: skip"):
        DataLoader(src, 4, 2, 256)


def test_cli_prepare_prints_figures_and_refuses_cleanly(tmp_path: Path, tok_dir: Path) -> None:
    runner = CliRunner()
    _write_jsonl(tmp_path / "d.jsonl", DOCS)
    res = runner.invoke(app, ["data", "prepare", str(tmp_path / "d.jsonl"), str(tmp_path / "out"),
                              "--tokenizer", str(tok_dir)])
    assert res.exit_code == 0, res.output
    n = len(_expected(str(tok_dir), DOCS))
    assert f"{n:,} tokens, {len(DOCS)} documents" in res.stdout and "tokens/s" in res.stdout
    again = runner.invoke(app, ["data", "prepare", str(tmp_path / "d.jsonl"), str(tmp_path / "out")])
    assert again.exit_code == 2 and "already exists" in again.output
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "a"}\n{"txt": "b"}\n')
    bad = runner.invoke(app, ["data", "prepare", str(tmp_path / "bad.jsonl"), str(tmp_path / "out2")])
    assert bad.exit_code == 2 and "bad.jsonl:2: missing field 'text'" in bad.output
    assert "nothing was written" in bad.output and not (tmp_path / "out2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out2")]
    nofile = runner.invoke(app, ["data", "prepare", str(tmp_path / "d.jsonl"), str(tmp_path / "o3"),
                                 "--tokenizer", str(tmp_path / "nope")])
    assert nofile.exit_code == 2 and "--tokenizer=" in nofile.output and "does not exist" in nofile.output
