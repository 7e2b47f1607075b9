"""What the data pipeline hands the train step, and how it reports data it cannot use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the readers and `prepare` load without torch
    import numpy as np
    import torch

# Targets with this id carry no loss: padding rows, and prompt tokens under the fine-tuning formats.
IGNORE_INDEX = -100


class DataError(ValueError):
    """Data that cannot be read or does not fit the model; the message names the field (or file and line)."""


@dataclass
class Batch:
    """One micro-batch of one rank: inputs and targets (batch, seq) int64; with `data.document_mask`,
    doc_ids (batch, seq) gives each input position's document (attention stays inside it)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    doc_ids: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(self.inputs[start:stop], self.targets[start:stop],
                     None if self.doc_ids is None else self.doc_ids[start:stop])


@dataclass
class Encoded:
    """Tokenized documents: a flat id array with EOS after each document, each document's length (EOS
    included) and, for the fine-tuning formats, a 0/1 mask per token (1: a target that carries loss)."""

    tokens: np.ndarray
    lengths: np.ndarray  # int64
    loss_mask: np.ndarray | None = None  # uint8; None: every target counts (format text)
    bytes_read: int = 0  # of the source, for progress
