"""Where the samples of a step come from: seeded synthetic sequences, or windows of a token corpus.

A window is seq_len+1 consecutive tokens of the corpus (inputs are the first seq_len, targets the
last): documents are packed end to end, EOS between them, and a window may hold the end of one and
the start of the next. With `data.document_mask` a window also carries the document of each input
position, so attention can stay inside each document; with a loss mask (fine-tuning formats) only
targets marked in it carry loss.

Windows are visited in a seeded order per epoch: global sample `index` (= step·B + j) is window
perm[epoch][index mod n], so the sample depends on (seed, index) alone. `split_windows` holds out a
seeded, fixed set of windows for evaluation; training then visits only the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallel.data.corpus import TokenCorpus
from parallel.data.types import DataError

EVAL_SPLIT_SEED = 0x5EED_E7A1  # mixed with data.seed to draw the held-out windows


@dataclass
class Window:
    tokens: np.ndarray  # (seq_len+1,) int64
    doc_ids: np.ndarray | None = None  # (seq_len,) document of each input position, from 0 in the window
    loss: np.ndarray | None = None  # (seq_len,) bool: which targets carry loss; None: all


class SyntheticSource:
    """Seeded sequences with learnable structure (a random start and a small random stride, mod vocab,
    with 10% noise), so losses fall and parity runs mean something."""

    n_windows: int | None = None

    def __init__(self, seq_len: int, vocab_size: int, seed: int) -> None:
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed

    def sample(self, index: int) -> Window:
        rng = np.random.default_rng([self.seed, index])
        n = self.seq_len + 1
        start = int(rng.integers(0, self.vocab_size))
        stride = int(rng.integers(1, 8))
        seq = (start + stride * np.arange(n, dtype=np.int64)) % self.vocab_size
        noise = rng.random(n) < 0.1
        seq[noise] = rng.integers(0, self.vocab_size, int(noise.sum()))
        return Window(seq)


def count_windows(corpus: TokenCorpus, seq_len: int) -> int:
    return max((corpus.n_tokens - 1) // seq_len, 0)


def split_windows(n_windows: int, split: float, seed: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(training windows, held-out windows), both sorted; the held-out ones drawn by (seed) alone."""
    n_eval = max(1, round(split * n_windows))
    if n_eval >= n_windows:
        raise DataError(
            f"{what} has {n_windows} windows: data.eval.split={split} would leave none to train on; "
            "use more data, a shorter training.seq_len or a smaller split"
        )
    held = np.random.default_rng([seed, EVAL_SPLIT_SEED]).permutation(n_windows)[:n_eval]
    mask = np.ones(n_windows, dtype=bool)
    mask[held] = False
    return np.flatnonzero(mask), np.sort(held)


class WindowSource:
    """Windows of a corpus; `ids` restricts them (a split's training windows), in a seeded order per epoch."""

    def __init__(self, corpus: TokenCorpus, seq_len: int, seed: int, *, document_mask: bool = False,
                 ids: np.ndarray | None = None) -> None:
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = seed
        total = count_windows(corpus, seq_len)
        if total < 1:
            raise DataError(
                f"{corpus.what} holds {corpus.n_tokens} tokens, fewer than training.seq_len+1={seq_len + 1}; "
                f"use more data or a shorter seq_len"
            )
        if document_mask and corpus.doc_ends is None:
            raise DataError(
                f"data.document_mask needs document boundaries, which {corpus.what} lacks (a flat tokens file); "
                "use a folder from `unbroken data prepare` or raw documents (text, jsonl, parquet, hf_dataset)"
            )
        self.document_mask = document_mask
        self.ids = ids
        self.n_windows = total if ids is None else len(ids)
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._epoch = epoch
        assert self._perm is not None
        return self._perm

    def window(self, w: int) -> Window:
        """Window number `w` of the corpus (its tokens [w·L, w·L + L + 1))."""
        start = w * self.seq_len
        stop = start + self.seq_len + 1
        c = self.corpus
        out = Window(np.asarray(c.tokens[start:stop], dtype=np.int64))
        if self.document_mask:
            assert c.doc_ends is not None
            docs = np.searchsorted(c.doc_ends, np.arange(start, stop - 1), side="right")
            out.doc_ids = (docs - docs[0]).astype(np.int64)
        if c.loss_mask is not None:
            out.loss = np.asarray(c.loss_mask[start + 1 : stop], dtype=bool)
        return out

    def window_id(self, index: int) -> int:
        epoch, pos = divmod(index, self.n_windows)
        w = int(self._order(epoch)[pos])
        return w if self.ids is None else int(self.ids[w])

    def sample(self, index: int) -> Window:
        """Global sample `index` (= step · global_batch_size + j)."""
        return self.window(self.window_id(index))
