"""parallel.regroup: a Trainer kept across a failure and a re-formed group of the same layout trains on
in the same objects, and its losses are bitwise those of a run never interrupted."""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel._spawn import init_group, run_ranks
from workers.ports import free_port


class _Fault(RuntimeError):
    pass


def _cfg(parallelism: dict[str, Any]) -> Any:
    from parallel.config import EngineConfig

    return EngineConfig.model_validate({
        "model": {"preset": "tiny"}, "parallelism": parallelism,
        "training": {"steps": 6, "seq_len": 16, "global_batch_size": 8, "micro_batch_size": 2},
    })  # fmt: skip


def _copy(state: Any) -> Any:
    """A deep copy of a state dict's values as plain local tensors (what a snapshot holds)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        return state.to_local().clone()
    return state.clone() if isinstance(state, torch.Tensor) else state


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    return bool(a == b)


def _load(trainer: Any, saved: Any) -> None:
    """Load a `_copy` back, shard by shard (the layout is the same)."""
    from torch.distributed.tensor import DTensor

    def fill(dst: Any, src: Any) -> None:
        for k, v in dst.items():
            if isinstance(v, dict):
                fill(v, src[k])
            elif isinstance(v, DTensor):
                v.to_local().copy_(src[k])
            elif isinstance(v, torch.Tensor):
                v.copy_(src[k])
            else:
                dst[k] = src[k]

    state = trainer.state_dict()
    fill(state, saved)
    trainer.load_state_dict(state)


def _kept_across_a_fault(rank: int, world: int, parallelism: dict[str, Any], fault_in: str,
                         ports: list[int]) -> dict[str, Any]:
    import torch.distributed as dist

    from parallel import regroup
    from parallel.trainer import Trainer

    cfg = _cfg(parallelism)
    ref = Trainer(cfg, device=torch.device("cpu"))
    ref_losses = [ref.train_step().loss for _ in range(6)]
    ref_state = _copy(ref.state_dict())
    del ref
    dist.destroy_process_group()  # each generation's group is new; the kept trainer's was built first in it
    init_group(rank, world, ports[0])

    trainer = Trainer(cfg, device=torch.device("cpu"))
    assert regroup.can_keep(trainer)
    losses = [trainer.train_step().loss for _ in range(3)]
    saved = _copy(trainer.state_dict())
    model, optimizer, data = trainer.model, trainer.optimizer, trainer.data
    # Step 4 breaks part way on every rank (a peer's death is the job tests' case): FSDP is left with
    # gathered parameters, hooks half run and gradients half reduced.
    def boom(*_: Any) -> None:
        raise _Fault(f"injected in {fault_in}")

    layer = list(trainer.model.layers.values())[-1]
    if fault_in == "backward":
        def arm(_m: Any, _i: Any, out: torch.Tensor) -> None:
            out.register_hook(boom)

        handle = layer.register_forward_hook(arm)
    else:
        handle = layer.register_forward_pre_hook(boom)
    try:
        trainer.train_step()
        raised = None
    except _Fault as e:
        raised = str(e)
    handle.remove()
    regroup.detach(trainer)
    dist.destroy_process_group()
    init_group(rank, world, ports[1])

    assert regroup.attach(trainer) is None, "the re-formed mesh's groups did not get the old names"
    from torch.distributed.distributed_c10d import _world

    live = all(g in _world.pg_map for g in trainer.mesh.get_all_groups())  # not the destroyed ones
    _load(trainer, saved)
    losses += [trainer.train_step().loss for _ in range(3)]
    same_state = _equal(_copy(trainer.state_dict()), ref_state)
    return {"ref": ref_losses, "losses": losses, "raised": raised, "same_state": same_state,
            "same_objects": trainer.model is model and trainer.optimizer is optimizer and trainer.data is data,
            "live_groups": live}  # fmt: skip


def _check(parallelism: dict[str, Any], fault_in: str) -> None:
    ports = [free_port()]
    while len(ports) < 2:  # one per group formed after the launch's own
        ports += [p for p in [free_port()] if p not in ports]
    for out in run_ranks(_kept_across_a_fault, 2, parallelism, fault_in, ports):
        assert out["raised"] == f"injected in {fault_in}", out
        assert out["same_objects"] and out["live_groups"], out
        assert out["losses"] == out["ref"], out  # bitwise: the same sums in the same order
        assert out["same_state"], "model or optimizer state differs from the uninterrupted run's"


def test_fsdp_kept_across_a_fault_in_backward() -> None:
    _check({}, "backward")


def test_tp_kept_across_a_fault_in_forward() -> None:
    _check({"tp": 2}, "forward")


def test_fsdp_unit_per_block_kept_across_a_fault_in_backward() -> None:
    """A big model's blocks are FSDP units of their own: the fault leaves some reduced, some not."""
    _check({"fsdp_unit_mib": 0}, "backward")
