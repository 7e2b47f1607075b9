"""A token corpus: the flat id stream the windows are cut from, with its document boundaries.

Three ways to get one, all giving the same `TokenCorpus`:
- a folder written by `unbroken data prepare` (memory-mapped: `tokens.bin`, `doc_ends.npy`,
  optional `loss_mask.bin`, `meta.json`, and the tokenizer's files under `tokenizer/`);
- a flat binary file of ids (`data.kind: tokens`; no document boundaries);
- raw data (text, jsonl, parquet, hf_dataset) tokenized in memory through the same code as
  `prepare` (parallel.data.encode), once per process.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallel.config import DataConfig
from parallel.data.readers import BadRows
from parallel.data.tokenizer import Tokenizer, load_tokenizer
from parallel.data.types import DataError

META_FILE = "meta.json"
TOKENS_FILE = "tokens.bin"
DOC_ENDS_FILE = "doc_ends.npy"
LOSS_MASK_FILE = "loss_mask.bin"
TOKENIZER_DIR = "tokenizer"
FORMAT_NAME = "unbroken-tokens"
FORMAT_VERSION = 1


@dataclass
class TokenCorpus:
    tokens: np.ndarray  # 1-D ids (array or memmap)
    doc_ends: np.ndarray | None  # int64 end offset (exclusive, EOS included) of each document; None: unknown
    loss_mask: np.ndarray | None  # uint8 per token: 1 where the token is a target carrying loss; None: all
    what: str  # names the source in messages
    vocab_size: int | None = None  # of the tokenizer that made it, when known
    tokenizer_fingerprint: str | None = None
    fmt: str = "text"

    @property
    def n_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def n_docs(self) -> int | None:
        return None if self.doc_ends is None else int(len(self.doc_ends))


def is_prepared(path: str | Path) -> bool:
    return (Path(path).expanduser() / META_FILE).is_file()


def read_meta(path: str | Path, what: str = "data.path") -> dict[str, Any]:
    p = Path(path).expanduser()
    try:
        meta = json.loads((p / META_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{what}={str(path)!r}: {META_FILE} cannot be read ({e}); prepare the data again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DataError(f"{what}={str(path)!r}: {META_FILE} was not written by `unbroken data prepare`")
    if int(meta.get("version", 0)) > FORMAT_VERSION:
        raise DataError(f"{what}={str(path)!r} was prepared by a newer Unbroken (format {meta['version']}); "
                        "upgrade, or prepare it again with this version")
    return meta


def prepared_tokenizer(path: str | Path) -> str | None:
    """The tokenizer folder a prepared data set carries (None: byte-level)."""
    folder = Path(path).expanduser() / TOKENIZER_DIR
    return str(folder) if folder.is_dir() else None


def open_prepared(path: str, what: str = "data.path") -> TokenCorpus:
    p = Path(path).expanduser()
    meta = read_meta(p, what)
    dtype = np.dtype(meta["dtype"])
    tokens_file = p / TOKENS_FILE
    size = tokens_file.stat().st_size if tokens_file.is_file() else -1
    if size != int(meta["tokens"]) * dtype.itemsize:
        raise DataError(f"{what}={path!r}: {TOKENS_FILE} holds {size} bytes, {META_FILE} says "
                        f"{meta['tokens']} {dtype.name} ids; the folder is damaged, prepare it again")
    tokens = np.memmap(tokens_file, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    doc_ends = np.load(p / DOC_ENDS_FILE, mmap_mode="r")
    mask = None
    if meta.get("loss_mask"):
        mask = np.memmap(p / LOSS_MASK_FILE, dtype=np.uint8, mode="r")
        if len(mask) != len(tokens):
            raise DataError(f"{what}={path!r}: {LOSS_MASK_FILE} does not match {TOKENS_FILE}; prepare it again")
    return TokenCorpus(tokens, doc_ends, mask, f"{what}={path!r}", int(meta["vocab_size"]),
                       meta.get("tokenizer", {}).get("fingerprint"), meta.get("data_format", "text"))


def open_flat(path: str, token_dtype: str, what: str = "data.path") -> TokenCorpus:
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{what}={path!r} is not a file or a prepared folder; data.kind=tokens reads a flat binary "
                        "file of ids or a folder written by `unbroken data prepare`")
    itemsize = np.dtype(token_dtype).itemsize
    prefix = what.rsplit(".", 1)[0]
    if p.stat().st_size % itemsize:
        raise DataError(
            f"{what}={path!r} has {p.stat().st_size} bytes, not a multiple of "
            f"{itemsize} ({token_dtype}); check {prefix}.token_dtype"
        )
    return TokenCorpus(np.memmap(p, dtype=np.dtype(token_dtype), mode="r"), None, None, f"{what}={path!r}")


def data_tokenizer(cfg: DataConfig, field: str = "data.tokenizer") -> Tokenizer:
    """The tokenizer of a data section: data.tokenizer, else the one a prepared folder carries, else bytes."""
    path = cfg.tokenizer
    if path is None and cfg.kind == "tokens" and cfg.path and is_prepared(cfg.path):
        path = prepared_tokenizer(cfg.path)
    return load_tokenizer(path, cfg.eos_token, field)


@functools.lru_cache(maxsize=4)
def _encoded(key: str) -> TokenCorpus:
    """Raw data tokenized once per process (a re-formed group rebuilds its Trainer: it must not
    tokenize again), keyed by the data section's source fields and the files' sizes and times."""
    from parallel.data.encode import encode_all

    spec = json.loads(key)
    cfg, what = DataConfig.model_validate(spec["cfg"]), spec["what"]
    prefix = what.rsplit(".", 1)[0]
    tok = data_tokenizer(cfg, f"{prefix}.tokenizer")
    enc = encode_all(cfg, tok, BadRows(cfg.on_bad_row, "data.on_bad_row: skip"), what)
    return TokenCorpus(enc.tokens, np.cumsum(enc.lengths), enc.loss_mask, f"{what}={cfg.path!r}",
                       tok.vocab_size, tok.fingerprint, cfg.format)


@functools.lru_cache(maxsize=8)
def _stamp(path: str, kind: str, hf_split: str) -> str:
    """The names, sizes and times of the files the source reads, once per process: a re-formed group
    builds a new Trainer, and walking a large folder again would lengthen every recovery. A job's data must
    not change under it anyway. A source that cannot be read gets an empty stamp: reading it says why."""
    from parallel.data.encode import source_files

    try:
        files = source_files(path, kind, hf_split)
    except DataError:
        return "[]"
    return json.dumps([[str(f), (st := f.stat()).st_size, st.st_mtime_ns] for f in files[:10000]])


def open_corpus(cfg: DataConfig, what: str = "data.path") -> TokenCorpus:
    """The corpus of a (non-synthetic) data section."""
    assert cfg.path is not None
    if cfg.kind == "tokens":
        if is_prepared(cfg.path):
            corpus = open_prepared(cfg.path, what)
            if cfg.format != corpus.fmt and "format" in cfg.model_fields_set:
                prefix = what.rsplit(".", 1)[0]
                raise DataError(f"{prefix}.format={cfg.format} but {cfg.path!r} was prepared with format "
                                f"{corpus.fmt}; prepare it again with --format {cfg.format} or drop {prefix}.format")
            return corpus
        return open_flat(cfg.path, cfg.token_dtype, what)
    path = str(Path(cfg.path).expanduser().resolve())
    fields = cfg.model_dump(include={"kind", "tokenizer", "eos_token", "text_field", "hf_split", "format",
                                     "chat_template", "on_bad_row"})
    key = json.dumps({"cfg": {**fields, "path": path}, "what": what, "stamp": _stamp(path, cfg.kind, cfg.hf_split)}, sort_keys=True)
    return _encoded(key)


def eval_config(cfg: DataConfig) -> DataConfig | None:
    """The eval set's own data section (None without one, or for `split`): unset fields are the training
    data's, the tokenizer included (for a prepared training folder, the one it carries)."""
    if cfg.eval is None or cfg.eval.split is not None:
        return None
    ecfg = cfg.eval_data()
    assert ecfg is not None
    if cfg.eval.tokenizer is None and ecfg.tokenizer is None:
        ecfg.tokenizer = data_tokenizer(cfg).path
    return ecfg
