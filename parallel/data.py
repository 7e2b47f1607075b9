"""The deterministic data pipeline: the global batch of step s depends on (data.seed, s) alone.

Sources (each yields windows of seq_len+1 tokens; inputs are the first seq_len, targets the last):
- synthetic: seeded sequences with learnable structure (a random start and a small random
  stride, mod vocab, with 10% noise), so losses fall and parity runs mean something;
- text: a UTF-8 file or a folder of them (read recursively, sorted; files that are not UTF-8
  are skipped), byte-level: token ids are the bytes 0..255;
- tokens: a flat binary file of token ids (np.memmap, dtype `data.token_dtype`).

Batch invariance: sample j (0 <= j < global_batch_size) of step s is fixed by (seed, s, j).
Each dp rank takes the contiguous slice [r*c, (r+1)*c) with c = ceil(B / dp); a rank whose
slice runs past B pads with samples whose targets are IGNORE_INDEX (zero weight), so every rank
runs the same number of micro-batches. The loss is the sum over real tokens divided by the global
token count (B * seq_len), so the trajectory does not depend on dp.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parallel.config import DataConfig

IGNORE_INDEX = -100

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), both (batch, seq) int64


class DataError(ValueError):
    """Data that cannot be read or does not fit the model; the message names the field."""


class _WindowSource:
    """Non-overlapping windows of a flat token array, visited in a seeded order per epoch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, what: str) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(
                f"{what} holds {len(tokens)} tokens, fewer than training.seq_len+1={seq_len + 1}; "
                f"use more data or a shorter seq_len"
            )
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._epoch = epoch
        assert self._perm is not None
        return self._perm

    def sample(self, index: int) -> np.ndarray:
        """Global sample `index` (= step * B + j): seq_len+1 tokens."""
        epoch, pos = divmod(index, self.n_windows)
        w = int(self._order(epoch)[pos])
        start = w * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)


class _SyntheticSource:
    def __init__(self, seq_len: int, vocab_size: int, seed: int) -> None:
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        n = self.seq_len + 1
        start = int(rng.integers(0, self.vocab_size))
        stride = int(rng.integers(1, 8))
        seq = (start + stride * np.arange(n, dtype=np.int64)) % self.vocab_size
        noise = rng.random(n) < 0.1
        seq[noise] = rng.integers(0, self.vocab_size, int(noise.sum()))
        return seq


# Folders under a text folder that hold caches or installed packages, not the text meant.
_SKIP_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages", "node_modules"})


def read_text_bytes(path: str) -> np.ndarray:
    """The bytes of a UTF-8 file, or of every UTF-8 file under a folder (sorted, joined by newlines).

    Under a folder, hidden entries and cache/package folders (__pycache__, site-packages, ...) are skipped.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path={path!r} does not exist; point it at a UTF-8 file or a folder of them")
    files = [p] if p.is_file() else sorted(
        f for f in p.rglob("*")
        if f.is_file() and not any(part in _SKIP_DIRS or part.startswith(".") for part in f.relative_to(p).parts)
    )
    chunks: list[bytes] = []
    for f in files:
        try:
            raw = f.read_bytes()
            raw.decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binaries and unreadable files are not text
        if raw:
            chunks.append(raw)
    if not chunks:
        raise DataError(f"data.path={path!r} holds no readable UTF-8 text; point it at text files")
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


@functools.lru_cache(maxsize=2)
def _cached_text(path: str) -> np.ndarray:
    """A process re-forming its group builds a new Trainer: reading a big folder again (seconds
    for the Python stdlib) would lengthen every recovery, so the bytes are kept per path."""
    return read_text_bytes(path)


def _build_source(cfg: DataConfig, seq_len: int, vocab_size: int) -> _WindowSource | _SyntheticSource:
    if cfg.kind == "synthetic":
        return _SyntheticSource(seq_len, vocab_size, cfg.seed)
    assert cfg.path is not None
    if cfg.kind == "text":
        if vocab_size < 256:
            raise DataError(
                f"data.kind=text is byte-level (ids 0..255) and needs model.vocab_size >= 256, "
                f"got {vocab_size}"
            )
        return _WindowSource(_cached_text(str(Path(cfg.path).expanduser().resolve())), seq_len, cfg.seed,
                             f"data.path={cfg.path!r}")
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise DataError(f"data.path={cfg.path!r} is not a file; data.kind=tokens reads a flat binary file of ids")
    itemsize = np.dtype(cfg.token_dtype).itemsize
    if path.stat().st_size % itemsize:
        raise DataError(
            f"data.path={cfg.path!r} has {path.stat().st_size} bytes, not a multiple of "
            f"{itemsize} ({cfg.token_dtype}); check data.token_dtype"
        )
    tokens = np.memmap(path, dtype=np.dtype(cfg.token_dtype), mode="r")
    return _WindowSource(tokens, seq_len, cfg.seed, f"data.path={cfg.path!r}")


class DataLoader:
    """Batches by step: stateless apart from the step, so its position is just a number."""

    def __init__(
        self, cfg: DataConfig, seq_len: int, global_batch_size: int, vocab_size: int,
        micro_batch_size: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.vocab_size = vocab_size
        self.micro_batch_size = micro_batch_size
        self.source = _build_source(cfg, seq_len, vocab_size)

    def sample(self, step: int, j: int) -> np.ndarray:
        seq = self.source.sample(step * self.global_batch_size + j)
        top = int(seq.max())
        if top >= self.vocab_size or int(seq.min()) < 0:
            raise DataError(
                f"token id {top} from data.path={self.cfg.path!r} is outside model.vocab_size={self.vocab_size}; "
                f"check data.token_dtype or raise vocab_size"
            )
        return seq

    def global_batch(self, step: int) -> MicroBatch:
        """The whole global batch of `step` (for references and tests)."""
        rows = np.stack([self.sample(step, j) for j in range(self.global_batch_size)])
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def micro_batches(self, step: int, dp_rank: int, dp: int) -> list[MicroBatch]:
        """This dp rank's slice of the global batch of `step`, cut into equal micro-batches.

        Every rank gets ceil(B/dp) rows rounded up to whole micro-batches; rows past B are
        padding whose targets are IGNORE_INDEX.
        """
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp - 1}")
        share = math.ceil(self.global_batch_size / dp)
        micro = min(self.micro_batch_size or share, share)
        n_micro = math.ceil(share / micro)
        inputs = torch.zeros(n_micro * micro, self.seq_len, dtype=torch.long)
        targets = torch.full((n_micro * micro, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        first = dp_rank * share
        for row, j in enumerate(range(first, min(first + share, self.global_batch_size))):
            seq = torch.from_numpy(self.sample(step, j))
            inputs[row] = seq[:-1]
            targets[row] = seq[1:]
        return [(inputs[i * micro : (i + 1) * micro], targets[i * micro : (i + 1) * micro]) for i in range(n_micro)]

    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def state_dict(self, step: int) -> dict[str, Any]:
        """The position: the next step to draw, plus what fixes the order (for a sanity check on load)."""
        return {"step": step, "seed": self.cfg.seed, "kind": self.cfg.kind, "global_batch_size": self.global_batch_size}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse to resume a run whose data order would silently change."""
        for key, mine in (("seed", self.cfg.seed), ("global_batch_size", self.global_batch_size)):
            if key in state and int(state[key]) != mine:
                raise DataError(
                    f"the checkpoint was written with data {key}={state[key]} but this run has {mine}; "
                    f"resume with the same value or start a new run"
                )
