"""The training loss: summed token cross-entropy, divided later by the global token count.

Summing (not averaging) per rank and dividing by the global count of real tokens makes the
loss independent of how the batch is split across dp ranks and micro-batches; padding rows
carry IGNORE_INDEX targets and add nothing. Under tensor parallelism with loss parallel the
logits are a DTensor sharded on the vocabulary and `loss_parallel()` computes the same sum
without gathering them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from parallel.data import IGNORE_INDEX


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over real tokens; logits (batch, seq, vocab), targets (batch, seq)."""
    loss = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )
    if isinstance(loss, DTensor):  # loss parallel: the sum is replicated over tp once materialised
        loss = loss.full_tensor()
    return loss


@contextlib.contextmanager
def loss_context(enabled: bool) -> Iterator[None]:
    """`loss_parallel()` when logits are vocab-sharded DTensors; forward and backward must run inside."""
    if not enabled:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield
