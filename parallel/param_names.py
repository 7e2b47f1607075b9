"""Parameter names independent of the wrappers a layout adds (activation checkpointing, compile, FSDP1).

Kept apart from parallel.model so modules the model builds on (parallel.moe) can name parameters
without importing the model.
"""

from __future__ import annotations

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Strip wrapper prefixes (activation checkpointing, compile) so names match across layouts."""
    for junk in _WRAPPER_PREFIXES:
        name = name.replace(junk, "")
    return name
