"""parallel.live_state: the kept model/optimizer mapping gives what `get_state_dict` gives, step after
step (the live tensors themselves, the learning rate of the moment) and after a load replaced the
optimizer's state; and a caller changing what it was handed does not change the next state."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from checkpointing.memory_storage import flatten
from parallel.trainer import Trainer
from tests.parallel.test_engine_units import tiny_cfg


def _same_as_dcp(trainer: Trainer, state: dict[str, Any]) -> None:
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    got, _ = flatten({"model": state["model"], "optim": state["optim"]})
    want, _ = flatten({"model": model_sd, "optim": optim_sd})
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k] is v or got[k].data_ptr() == v.data_ptr(), k  # the live tensor, not a copy
        else:
            assert got[k] == v, (k, got[k], v)


def test_kept_state_matches_get_state_dict_across_steps_and_a_load() -> None:
    trainer = Trainer(tiny_cfg(steps=8, warmup_steps=4), device=torch.device("cpu"))
    trainer.train_step()
    lrs = []
    for _ in range(3):
        trainer.train_step()
        state = trainer.state_dict()
        _same_as_dcp(trainer, state)
        lrs.append(state["optim"]["param_groups"][0]["lr"])
    assert len(set(lrs)) >= 2, lrs  # warmup: the learning rate of each step, not the first one's

    # A caller replacing entries of what it got (DCP's load does for non-tensor values) changes nothing kept.
    state["optim"]["param_groups"][0]["lr"] = 123.0
    state["model"].clear()
    _same_as_dcp(trainer, trainer.state_dict())

    # A load replaces the optimizer's state: the mapping follows the new tensors.
    other = Trainer(tiny_cfg(steps=8, warmup_steps=4), device=torch.device("cpu"))
    other.train_step()
    other.load_state_dict(trainer.state_dict())
    _same_as_dcp(other, other.state_dict())
    assert other.train_step().loss == trainer.train_step().loss
