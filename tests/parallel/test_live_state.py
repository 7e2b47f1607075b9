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


def _restore_in_place(rank: int, world: int, ckpt: str) -> tuple[bool, bool, list[float], list[float]]:
    """Trainer A trains 2 steps and is saved with DCP; a fresh B (another layout's restore: built anew)
    loads it into its own `state_dict()`, in place, as a restore from the keepers does. Returns whether B
    kept its optimizer-state and parameter objects (no copy back), and A's and B's next 3 losses."""
    import torch.distributed.checkpoint as dcp

    cfg = tiny_cfg(steps=8, warmup_steps=4)
    a = Trainer(cfg, device=torch.device("cpu"))
    a.train_step()
    a.train_step()
    dcp.save({k: v for k, v in a.state_dict().items() if k in ("model", "optim")}, checkpoint_id=ckpt,
             no_dist=world == 1)
    b = Trainer(cfg, device=torch.device("cpu"), restoring=True)
    state = b.state_dict()
    opt_state, params = b.optimizer.state, [p for g in b.optimizer.param_groups for p in g["params"]]
    part = {k: state[k] for k in ("model", "optim")}
    dcp.load(part, checkpoint_id=ckpt, no_dist=world == 1)
    state.update(part, step=a.step, scheduler={"last_epoch": a.step}, data=a.data.state_dict(a.step),
                 rng={"seed": cfg.training.seed, "cpu": torch.get_rng_state()})
    b.load_state_dict(state)
    kept = b.optimizer.state is opt_state and all(p is q for p, q in zip(
        params, [p for g in b.optimizer.param_groups for p in g["params"]], strict=True))
    same_lr = b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]
    return kept, same_lr, [a.train_step().loss for _ in range(3)], [b.train_step().loss for _ in range(3)]


def test_a_state_loaded_in_place_is_not_copied_back_and_trains_on_the_same(tmp_path: Any) -> None:
    kept, same_lr, want, got = _restore_in_place(0, 1, str(tmp_path / "one"))
    assert kept and same_lr
    assert got == want  # the same process's math on the same values: bitwise


def test_in_place_load_over_fsdp_shards(tmp_path: Any) -> None:
    from tests.parallel._spawn import run_ranks

    for kept, same_lr, want, got in run_ranks(_restore_in_place, 2, str(tmp_path / "two")):
        assert kept and same_lr
        assert got == want


def test_a_state_of_other_tensors_is_still_loaded() -> None:
    """A state whose tensors are not this trainer's (another trainer's, a fallback's copy) goes through
    DCP's set_state_dict, as before."""
    cfg = tiny_cfg(steps=8, warmup_steps=4)
    a, b = Trainer(cfg, device=torch.device("cpu")), Trainer(cfg, device=torch.device("cpu"))
    a.train_step()
    b.train_step()
    b.train_step()
    state = b.state_dict()
    assert not a._live_state.holds(a.optimizer, state["model"], state["optim"])
    a.load_state_dict(state)
    assert a.train_step().loss == b.train_step().loss
