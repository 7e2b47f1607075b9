"""export-hf writes, by default, the tokenizer the job trained with (recorded in its config)."""

from __future__ import annotations

from pathlib import Path

from tests.data.local_tokenizer import make_tokenizer
from workers.export_source import recorded_tokenizer


def test_recorded_tokenizer_of_a_job(tmp_path: Path) -> None:
    tok = make_tokenizer(tmp_path / "tok")
    data = tmp_path / "corpus.jsonl"
    data.write_text('{"text": "hello"}\n')
    assert recorded_tokenizer({"data": {"kind": "jsonl", "path": str(data), "tokenizer": str(tok)}}) == str(tok)
    assert recorded_tokenizer({"data": {"kind": "text", "path": str(data)}}) is None  # byte-level: none to write
    assert recorded_tokenizer(None) is None and recorded_tokenizer({"model": {}}) is None
    # A tokenizer that is no longer on this machine: none by default (then --tokenizer names one).
    gone = {"data": {"kind": "jsonl", "path": str(data), "tokenizer": str(tmp_path / "gone" / "tokenizer.json")}}
    assert recorded_tokenizer(gone) is None
