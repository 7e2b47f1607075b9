"""The model and optimizer entries of a train state, built once and kept: they hold live tensors.

DCP's `get_state_dict` maps every parameter and optimizer state to its fully qualified name, which
costs milliseconds of Python on the training thread per call (1.8 ms for the debug preset, more for
sharded models) while the tensors it returns are the parameters and optimizer states themselves,
updated in place by every step. A snapshot every step needs the mapping every step; it is kept here
and only the optimizer's hyper-parameters (the learning rate moves every step) are read anew.

The kept mapping is dropped when the optimizer's state is replaced or grows (a load, the first step)
or on `drop()`; it is never handed out itself: callers get new outer dicts, so an entry a caller
replaces (DCP does for non-tensor values) stays out of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class LiveStateDict:
    def __init__(self) -> None:
        self._kept: tuple[Any, int, dict[str, Any], dict[str, Any]] | None = None

    def drop(self) -> None:
        self._kept = None

    def get(self, model: nn.Module | list[nn.Module], optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(model_sd, optim_sd) as `get_state_dict(model, optimizer)` returns them."""
        opt_state = optimizer.state
        kept = self._kept
        if kept is None or kept[0] is not opt_state or kept[1] != len(opt_state) or not opt_state:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            kept = self._kept = (opt_state, len(opt_state), model_sd, optim_sd)
        _, _, model_sd, optim_sd = kept
        groups = [{**{k: v for k, v in live.items() if k != "params"}, "params": list(mapped["params"])}
                  for live, mapped in zip(optimizer.param_groups, optim_sd["param_groups"], strict=True)]  # fmt: skip
        state = {k: dict(v) for k, v in optim_sd["state"].items()}
        return dict(model_sd), {"state": state, "param_groups": groups}
