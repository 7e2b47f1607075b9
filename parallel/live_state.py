"""The model and optimizer entries of a train state, built once and kept: they hold live tensors.

DCP's `get_state_dict` maps every parameter and optimizer state to its fully qualified name, which
costs milliseconds of Python on the training thread per call (1.8 ms for the debug preset, more for
sharded models) while the tensors it returns are the parameters and optimizer states themselves,
updated in place by every step. A snapshot every step needs the mapping every step; it is kept here
and only the optimizer's hyper-parameters (the learning rate moves every step) are read anew.

The kept mapping is dropped when the optimizer's state is replaced or grows (a load, the first step)
or on `drop()`; it is never handed out itself: callers get new outer dicts, so an entry a caller
replaces (DCP does for non-tensor values) stays out of it.

A restore loads into what `get` handed out: DCP's load writes into the given tensors in place, so the
parameters and optimizer states already hold the loaded values. `holds` says so, and the trainer then
skips DCP's `set_state_dict`, which would copy each tensor onto itself (~45 ms of Python for the
debug preset on each rank of every re-form).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


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

    def holds(self, optimizer: torch.optim.Optimizer, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> bool:
        """Whether every tensor of (model_sd, optim_sd) is a live one: each optimizer state the very tensor
        `optimizer.state` holds for its parameter, each model entry a view of exactly its elements, with the
        same names and nothing else. Then a state loaded into them in place needs no copying back."""
        kept = self._kept
        if kept is None or kept[0] is not optimizer.state or kept[1] != len(optimizer.state):
            return False
        live_model, live_optim = kept[2], kept[3]
        state = optim_sd.get("state")
        groups = optim_sd.get("param_groups")
        if (model_sd.keys() != live_model.keys() or not isinstance(state, dict)
                or state.keys() != live_optim["state"].keys() or not isinstance(groups, list)
                or not len(groups) == len(optimizer.param_groups) == len(live_optim["param_groups"])):
            return False
        covered = set()
        for live, mapped, loaded in zip(optimizer.param_groups, live_optim["param_groups"], groups, strict=True):
            if (not isinstance(loaded, dict) or list(loaded.get("params", ())) != list(mapped["params"])
                    or len(live["params"]) != len(mapped["params"])):
                return False  # e.g. a parameter group added since the mapping was built
            for param, name in zip(live["params"], mapped["params"], strict=True):
                entries, now = state.get(name), optimizer.state.get(param)
                if not isinstance(entries, dict) or now is None or entries.keys() != now.keys():
                    return False
                if any(v is not now[k] for k, v in entries.items()):
                    return False
                if name in model_sd:
                    if not _same_storage(model_sd[name], param):
                        return False
                    covered.add(name)
        return covered == model_sd.keys()


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (the object, no dispatch, unlike `to_local()`), else the tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _same_storage(a: Any, b: torch.Tensor) -> bool:
    """Whether tensor `a` views exactly `b`'s elements (their local shards, for DTensors)."""
    if not isinstance(a, torch.Tensor):
        return False
    a, b = local_shard(a), local_shard(b)
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
