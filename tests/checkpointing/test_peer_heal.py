"""checkpointing.peer_heal: in an HSDP layout (2 replicas x 2 shards) a newcomer (a fresh trainer in a
dead rank's place) takes its state from the live replica that holds the same shards; with the
survivors kept in place (parallel.regroup), the next steps equal an uninterrupted run bitwise."""

from __future__ import annotations

from typing import Any

import torch

from tests.parallel._spawn import init_group, run_ranks
from tests.parallel.test_regroup import _cfg, _copy, _equal, _load
from workers.ports import free_port

NEWCOMER = 2  # replica 1, shard 0: its peer is rank 0


def _heal(rank: int, world: int, ports: list[int]) -> dict[str, Any]:
    import torch.distributed as dist

    from checkpointing import peer_heal
    from parallel import regroup
    from parallel.trainer import Trainer

    cfg = _cfg({"dp_replicate": 2, "dp_shard": 2})
    ref = Trainer(cfg, device=torch.device("cpu"))
    ref_losses = [ref.train_step().loss for _ in range(6)]
    ref_state = _copy(ref.state_dict())
    del ref
    dist.destroy_process_group()
    init_group(rank, world, ports[0])

    trainer = Trainer(cfg, device=torch.device("cpu"))
    losses = [trainer.train_step().loss for _ in range(3)]
    saved = _copy(trainer.state_dict())  # what the keepers hold
    trainer.train_step()  # a step past the snapshot: the survivors must roll back
    regroup.detach(trainer)
    dist.destroy_process_group()
    init_group(rank, world, ports[1])
    if rank == NEWCOMER:  # a spare in the dead rank's place: a new trainer, no state
        trainer = Trainer(cfg, device=torch.device("cpu"))
    else:
        assert regroup.attach(trainer) is None
    plan = peer_heal.plan(trainer, in_place=rank != NEWCOMER)
    assert plan is not None
    if plan.reads(rank):
        _load(trainer, saved)
    state = trainer.state_dict()
    nbytes = peer_heal.share(state, plan, rank)
    if not plan.reads(rank):
        trainer.load_state_dict(state)
    losses += [trainer.train_step().loss for _ in range(3)]
    return {"ref": ref_losses, "losses": losses, "ranks": plan.ranks, "source": plan.source, "nbytes": nbytes,
            "same_state": _equal(_copy(trainer.state_dict()), ref_state)}  # fmt: skip


def test_a_newcomer_heals_from_its_live_replica() -> None:
    ports = [free_port()]
    while len(ports) < 2:
        ports += [p for p in [free_port()] if p not in ports]
    outs = run_ranks(_heal, 4, ports)
    # Replicas hold the same shards: {0, 2} and {1, 3}; each group's reader is a rank that kept its trainer.
    assert [(o["ranks"], o["source"]) for o in outs] == [([0, 2], 0), ([1, 3], 1), ([0, 2], 0), ([1, 3], 1)]
    assert outs[NEWCOMER]["nbytes"] > 0
    for out in outs:
        assert out["losses"] == out["ref"], out
        assert out["same_state"], "a rank's state differs from the uninterrupted run's"
