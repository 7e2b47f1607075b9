"""`unbroken data prepare`: tokenize a raw data set once into a folder a job can point at.

The folder (see parallel.data.corpus) holds the `tokens` format (a flat id file) plus an index of
document boundaries (EOS between documents), the loss mask of the fine-tuning formats, the
tokenizer's files and `meta.json`. It is written under a temporary name beside OUT and renamed
only when complete, so a failure or an interrupt never leaves a half-written data set.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from parallel.config import DataConfig
from parallel.data.corpus import (
    DOC_ENDS_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    LOSS_MASK_FILE,
    META_FILE,
    TOKENIZER_DIR,
    TOKENS_FILE,
)
from parallel.data.encode import encode_source
from parallel.data.readers import BadRows
from parallel.data.tokenizer import Tokenizer, dtype_for_vocab, save_tokenizer
from parallel.data.types import DataError


@dataclass
class PrepareResult:
    out: Path
    tokens: int
    documents: int
    seconds: float
    skipped_rows: int = 0
    skipped_examples: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def prepare_dataset(
    src: DataConfig, out: str | Path, tok: Tokenizer, *, progress: Callable[[int], None] | None = None,
    what: str = "SRC",
) -> PrepareResult:
    """Tokenize `src` (a raw data section: kind, path, format, fields) into the folder `out`.

    Refuses an existing `out`. `progress(n)` is called with the source bytes of each batch done.
    """
    out = Path(out).expanduser().resolve()
    if out.exists():
        raise DataError(f"OUT={str(out)!r} already exists; choose a new folder or remove it first")
    if not out.parent.is_dir():
        raise DataError(f"OUT's parent folder {str(out.parent)!r} does not exist; create it first")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    bad = BadRows(src.on_bad_row, "--on-bad-row skip")
    dtype = dtype_for_vocab(tok.vocab_size)
    t0 = time.perf_counter()
    try:
        n_tokens = 0
        ends: list[np.ndarray] = []
        with_mask: bool | None = None
        with (tmp / TOKENS_FILE).open("wb") as ftok, (tmp / LOSS_MASK_FILE).open("wb") as fmask:
            for enc in encode_source(src, tok, bad, what):
                enc.tokens.astype(dtype, copy=False).tofile(ftok)
                if enc.loss_mask is not None:
                    enc.loss_mask.astype(np.uint8, copy=False).tofile(fmask)
                with_mask = enc.loss_mask is not None
                ends.append(n_tokens + np.cumsum(enc.lengths))
                n_tokens += len(enc.tokens)
                if progress is not None:
                    progress(enc.bytes_read)
        doc_ends = np.concatenate(ends) if ends else np.zeros(0, np.int64)
        if not len(doc_ends):
            raise DataError(f"{what}={str(src.path)!r} holds no usable documents" +
                            (f" ({bad.count} bad rows skipped, e.g. {bad.examples[0]})" if bad.count else ""))
        np.save(tmp / DOC_ENDS_FILE, doc_ends.astype(np.int64))
        if not with_mask:
            (tmp / LOSS_MASK_FILE).unlink()
        save_tokenizer(tok, tmp / TOKENIZER_DIR)
        meta = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "dtype": dtype.name, "tokens": n_tokens,
            "documents": int(len(doc_ends)), "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "tokenizer": {"name": tok.name, "fingerprint": tok.fingerprint},
            "data_format": src.format, "loss_mask": bool(with_mask), "source": {"kind": src.kind, "path": src.path},
            "skipped_rows": bad.count, "created_at": time.time(),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PrepareResult(out, n_tokens, int(len(doc_ends)), time.perf_counter() - t0, bad.count, bad.examples)
