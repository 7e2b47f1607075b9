"""Activation checkpointing of transformer blocks.

- none: keep every activation.
- full: recompute each block's forward during backward (keeps only block inputs).
- selective: layer-level selective AC, as torchtitan's `selective_ac_option: "2"`:
  checkpoint every other block (layer ids 0, 2, 4, ...), trading half the memory saving
  for half the recomputation. (Op-level SAC is not used: its save-list of ops would have to
  follow each torch release.)

Blocks are wrapped in place in `model.layers`; the wrapper adds `_checkpoint_wrapped_module.`
to parameter names, which state dicts strip (and `parallel.model.canonical_name` too).
"""

from __future__ import annotations

from typing import Literal

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def apply_ac(model: nn.Module, mode: Literal["none", "full", "selective"]) -> nn.Module:
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ValueError(f"training.activation_checkpointing={mode!r}; use none, full or selective")
    layers = model.layers
    assert isinstance(layers, nn.ModuleDict)
    for name, block in list(layers.items()):
        if mode == "full" or int(name) % 2 == 0:
            # The default non-reentrant impl works with DTensors and FSDP2 hooks; no RNG to keep.
            layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    return model
