"""Raw records to token ids: the one tokenization path of `unbroken data prepare` and of jobs on raw data.

`encode_source(cfg, tokenizer, bad)` reads the data section's files (parallel.data.readers) and
yields `Encoded` batches: a flat id array in which every document is followed by the EOS id, each
document's length (EOS included) and, for the fine-tuning formats, a 0/1 loss mask per token (1:
the token is a target that carries loss). Reading runs in a thread ahead of tokenization, which
runs on every core (the tokenizers library encodes a batch in parallel and releases the GIL).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from parallel.config import DataConfig
from parallel.data.readers import (
    SUFFIXES,
    BadRows,
    Row,
    hf_dataset_files,
    list_files,
    read_hf_dataset,
    read_jsonl,
    read_parquet,
    read_text,
)
from parallel.data.tokenizer import Tokenizer
from parallel.data.types import DataError, Encoded

RAW_KINDS = ("text", "jsonl", "parquet", "hf_dataset")


def record_fields(cfg: DataConfig) -> tuple[tuple[str, ...], tuple[type, ...]]:
    """The fields a row must have under `data.format`, and their types."""
    if cfg.format == "prompt_completion":
        return ("prompt", "completion"), (str, str)
    if cfg.format == "chat":
        return ("messages",), (list,)
    return (cfg.text_field,), (str,)


def source_files(path: str, kind: str, hf_split: str = "train") -> list[Path]:
    """The files a raw data source of this kind reads."""
    if kind == "hf_dataset":
        return hf_dataset_files(path, hf_split)
    return list_files(path, SUFFIXES.get(kind))


def source_size(cfg: DataConfig) -> int:
    """Bytes of the source files (for a progress bar)."""
    assert cfg.path is not None
    return sum(f.stat().st_size for f in source_files(cfg.path, cfg.kind, cfg.hf_split))


def read_rows(cfg: DataConfig, bad: BadRows, what: str = "data.path") -> Iterator[list[Row]]:
    """Batches of rows of a raw data section (kinds text, jsonl, parquet, hf_dataset)."""
    assert cfg.path is not None
    fields, kinds = record_fields(cfg)
    prefix = what.rsplit(".", 1)[0]
    hint = (f"set {prefix}.text_field to the column holding the text" if cfg.format == "text"
            else f"{prefix}.format={cfg.format} reads columns {', '.join(fields)}")
    if cfg.kind == "text":
        return read_text(cfg.path, what)
    if cfg.kind == "jsonl":
        return read_jsonl(cfg.path, fields, kinds, bad, what)
    if cfg.kind == "parquet":
        return read_parquet(cfg.path, fields, kinds, bad, hint, what)
    if cfg.kind == "hf_dataset":
        return read_hf_dataset(cfg.path, cfg.hf_split, fields, kinds, bad, hint, what)
    raise DataError(f"data.kind={cfg.kind!r} is not raw data; {RAW_KINDS} are tokenized")


def encode_rows(rows: list[Row], cfg: DataConfig, tok: Tokenizer, bad: BadRows) -> Encoded:
    if cfg.format == "text":
        tokens, lengths = tok.encode_documents([r.values[0] for r in rows])
        return Encoded(tokens, lengths)
    from parallel.data.formats import encode_finetune  # prompt/completion and chat turns

    return encode_finetune(rows, cfg, tok, bad)


def _size_of(rows: list[Row]) -> int:
    """Approximate source bytes of a batch (for progress; exact for text)."""
    return sum(len(v) if isinstance(v, str) else 64 for r in rows for v in r.values)


def encode_source(cfg: DataConfig, tok: Tokenizer, bad: BadRows, what: str = "data.path",
                  prefetch: int = 4) -> Iterator[Encoded]:
    """Encoded batches of the whole source, in order; rows are read in a thread ahead of encoding."""
    q: queue.Queue[list[Row] | BaseException | None] = queue.Queue(maxsize=prefetch)
    stop = threading.Event()

    def produce() -> None:
        try:
            for rows in read_rows(cfg, bad, what):
                while not stop.is_set():
                    try:
                        q.put(rows, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(None)
        except BaseException as e:  # handed to the consumer, which raises it
            q.put(e)

    t = threading.Thread(target=produce, name="data-reader", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            enc = encode_rows(item, cfg, tok, bad)
            enc.bytes_read = _size_of(item)
            yield enc
    finally:
        stop.set()
        while t.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                t.join(timeout=0.05)


def encode_all(cfg: DataConfig, tok: Tokenizer, bad: BadRows, what: str = "data.path",
               progress: Callable[[int], None] | None = None) -> Encoded:
    """The whole source in memory (jobs on raw data; `unbroken data prepare` streams to disk instead)."""
    parts = []
    for enc in encode_source(cfg, tok, bad, what):
        parts.append(enc)
        if progress is not None:
            progress(enc.bytes_read)
    if not parts:
        raise DataError(f"{what}={cfg.path!r} holds no usable documents" +
                        (f" ({bad.count} bad rows skipped, e.g. {bad.examples[0]})" if bad.count else "") +
                        "; point it at UTF-8 text (files that are not UTF-8 are skipped), or set data.kind "
                        "to the format the files are in")
    masks = [p.loss_mask for p in parts]
    return Encoded(
        tokens=np.concatenate([p.tokens for p in parts]),
        lengths=np.concatenate([p.lengths for p in parts]),
        loss_mask=None if masks[0] is None else np.concatenate(masks),  # type: ignore[arg-type]
        bytes_read=sum(p.bytes_read for p in parts),
    )


def infer_kind(path: str) -> str:
    """The raw kind of a source path: by extension, or by what a folder holds."""
    p = Path(path).expanduser()
    if p.is_file():
        name = p.name.lower()
        if name.endswith((".jsonl", ".json")):
            return "jsonl"
        if name.endswith(".parquet"):
            return "parquet"
        return "text"
    if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
        return "hf_dataset"
    if p.is_dir():
        for kind, pattern in (("jsonl", "*.jsonl"), ("parquet", "*.parquet")):
            if next(p.rglob(pattern), None) is not None:
                return kind
        return "text"
    raise DataError(f"{path!r} does not exist; give a file or a folder of data")
