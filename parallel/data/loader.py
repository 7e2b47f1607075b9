"""The deterministic data pipeline: the global batch of step s depends on (data.seed, s) alone.

Sources (parallel.data.sources): synthetic sequences, or windows of a token corpus
(parallel.data.corpus) built from text files, JSONL, Parquet or `datasets` folders (tokenized
in memory), a folder from `unbroken data prepare`, or a flat binary file of ids.

Batch invariance: sample j (0 <= j < global_batch_size) of step s is fixed by (seed, s, j).
Each dp rank takes the contiguous slice [r*c, (r+1)*c) with c = ceil(B / dp); a rank whose
slice runs past B pads with samples whose targets are IGNORE_INDEX (zero weight), so every rank
runs the same number of micro-batches. The loss is the sum over loss-bearing tokens divided by
their global count in the step (B * seq_len without a loss mask), which every rank computes from
the data alone, so the trajectory does not depend on dp.

Evaluation (`data.eval`): a fixed list of windows — the first `sequences` of the eval set, or of
the windows `split` holds out of the training data — cut into batches of global_batch_size rows
and sliced over dp ranks exactly as training batches are.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from parallel.config import DataConfig
from parallel.data.corpus import TokenCorpus, data_tokenizer, eval_config, open_corpus
from parallel.data.sources import SyntheticSource, Window, WindowSource, count_windows, split_windows
from parallel.data.types import IGNORE_INDEX, Batch, DataError


def check_vocab(corpus: TokenCorpus, vocab_size: int, field: str) -> None:
    if corpus.vocab_size is not None and corpus.vocab_size > vocab_size:
        raise DataError(
            f"{field}: the tokenizer of {corpus.what} has {corpus.vocab_size} ids but model.vocab_size={vocab_size}; "
            f"raise model.vocab_size to at least {corpus.vocab_size} or use a smaller tokenizer"
        )


def _open(cfg: DataConfig, vocab_size: int, prefix: str) -> TokenCorpus:
    corpus = open_corpus(cfg, f"{prefix}.path")
    if cfg.tokenizer is not None and corpus.tokenizer_fingerprint is not None:
        tok = data_tokenizer(cfg, f"{prefix}.tokenizer")
        if tok.fingerprint != corpus.tokenizer_fingerprint:
            raise DataError(
                f"{prefix}.tokenizer={cfg.tokenizer!r} differs from the tokenizer {corpus.what} was prepared with; "
                f"drop {prefix}.tokenizer (the folder carries its own) or prepare the data again with it"
            )
    check_vocab(corpus, vocab_size, f"{prefix}.tokenizer")
    return corpus


class EvalSet:
    """The fixed evaluation windows, in order."""

    def __init__(self, source: WindowSource, windows: np.ndarray) -> None:
        self.source = source
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def sample(self, i: int) -> Window:
        return self.source.window(int(self.windows[i]))


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
        self.eval_set: EvalSet | None = None
        self.source: SyntheticSource | WindowSource
        if cfg.kind == "synthetic":
            self.source = SyntheticSource(seq_len, vocab_size, cfg.seed)
        else:
            if cfg.kind == "text" and cfg.tokenizer is None and vocab_size < 256:
                raise DataError(
                    f"data.kind=text is byte-level (ids 0..255) and needs model.vocab_size >= 256, got {vocab_size}"
                )
            corpus = _open(cfg, vocab_size, "data")
            ids = None
            if cfg.eval is not None and cfg.eval.split is not None:
                ids, held = split_windows(count_windows(corpus, seq_len), cfg.eval.split, cfg.seed, corpus.what)
                held_src = WindowSource(corpus, seq_len, cfg.seed, document_mask=cfg.document_mask)
                self.eval_set = EvalSet(held_src, held[: cfg.eval.sequences])
            self.source = WindowSource(corpus, seq_len, cfg.seed, document_mask=cfg.document_mask, ids=ids)
        ecfg = eval_config(cfg)
        if ecfg is not None:
            assert cfg.eval is not None
            ecorpus = _open(ecfg, vocab_size, "data.eval")
            esrc = WindowSource(ecorpus, seq_len, cfg.seed, document_mask=cfg.document_mask)
            self.eval_set = EvalSet(esrc, np.arange(min(cfg.eval.sequences, esrc.n_windows)))
        self._loss_tokens: tuple[int, int] | None = None  # (step, count) of the last step asked for
        self._eval_tokens: int | None = None

    # --- samples -------------------------------------------------------------------------------
    def _checked(self, w: Window) -> Window:
        top = int(w.tokens.max())
        if top >= self.vocab_size or int(w.tokens.min()) < 0:
            raise DataError(
                f"token id {top} from data.path={self.cfg.path!r} is outside model.vocab_size={self.vocab_size}; "
                f"check data.token_dtype or raise vocab_size"
            )
        return w

    def sample(self, step: int, j: int) -> Window:
        return self._checked(self.source.sample(step * self.global_batch_size + j))

    def _rows(self, windows: list[Window], n_rows: int) -> Batch:
        """`windows` as the first rows of a batch of `n_rows`; the rest are padding (targets IGNORE_INDEX)."""
        inputs = torch.zeros(n_rows, self.seq_len, dtype=torch.long)
        targets = torch.full((n_rows, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        doc_ids = torch.zeros(n_rows, self.seq_len, dtype=torch.long) if self.cfg.document_mask else None
        for row, w in enumerate(windows):
            seq = torch.from_numpy(w.tokens)
            inputs[row] = seq[:-1]
            tgt = seq[1:].clone()
            if w.loss is not None:
                tgt[~torch.from_numpy(w.loss)] = IGNORE_INDEX
            targets[row] = tgt
            if doc_ids is not None and w.doc_ids is not None:
                doc_ids[row] = torch.from_numpy(w.doc_ids)
        return Batch(inputs, targets, doc_ids)

    def global_batch(self, step: int) -> Batch:
        """The whole global batch of `step` (for references and tests)."""
        B = self.global_batch_size
        return self._rows([self.sample(step, j) for j in range(B)], B)

    def _slice(self, windows_of: Any, n: int, dp_rank: int, dp: int) -> list[Batch]:
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp - 1}")
        share = math.ceil(self.global_batch_size / dp)
        micro = min(self.micro_batch_size or share, share)
        n_micro = math.ceil(share / micro)
        first = dp_rank * share
        batch = self._rows([windows_of(j) for j in range(first, min(first + share, n))], n_micro * micro)
        return [batch.rows(i * micro, (i + 1) * micro) for i in range(n_micro)]

    def micro_batches(self, step: int, dp_rank: int, dp: int) -> list[Batch]:
        """This dp rank's slice of the global batch of `step`, cut into equal micro-batches.

        Every rank gets ceil(B/dp) rows rounded up to whole micro-batches; rows past B are
        padding whose targets are IGNORE_INDEX.
        """
        return self._slice(lambda j: self.sample(step, j), self.global_batch_size, dp_rank, dp)

    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    def loss_tokens(self, step: int) -> int:
        """Targets that carry loss in the whole global batch of `step` (the loss's denominator):
        B * seq_len, unless a loss mask leaves some out. Every rank computes it from the data alone."""
        src = self.source
        if not isinstance(src, WindowSource) or src.corpus.loss_mask is None:
            return self.tokens_per_step()
        if self._loss_tokens is None or self._loss_tokens[0] != step:
            n = sum(int(src.sample(step * self.global_batch_size + j).loss.sum())  # type: ignore[union-attr]
                    for j in range(self.global_batch_size))
            self._loss_tokens = (step, n)
        return self._loss_tokens[1]

    # --- evaluation ----------------------------------------------------------------------------
    def eval_batches(self, dp_rank: int, dp: int) -> list[list[Batch]]:
        """The eval set as batches of global_batch_size windows; each this rank's micro-batches."""
        es = self.eval_set
        if es is None:
            return []
        B = self.global_batch_size
        out = []
        for k in range(math.ceil(len(es) / B)):
            n = min(B, len(es) - k * B)
            out.append(self._slice(lambda j, k=k: self._checked(es.sample(k * B + j)), n, dp_rank, dp))
        return out

    def eval_tokens(self) -> int:
        """Targets that carry loss in the whole eval set (the eval loss's denominator)."""
        if self._eval_tokens is None:
            es = self.eval_set
            if es is None:
                return 0
            self._eval_tokens = sum(
                self.seq_len if (w := es.sample(i)).loss is None else int(w.loss.sum()) for i in range(len(es))
            )
        return self._eval_tokens

    # --- position ------------------------------------------------------------------------------
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
