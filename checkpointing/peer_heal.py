"""Heal from a live peer: in a layout with data-parallel replicas (HSDP, DDP), the ranks of one replicate
group hold the same shards, so at a restore one of them reads the committed snapshot and gives it to
the others over the group (a broadcast of its local tensors) instead of each reading the keepers.

The reader is a rank that kept its trainer through the re-form (workers.kept_trainer), where there is
one: it survived, and the keeper on its own node holds its shard. A newcomer in the same group (a spare
that took a dead rank's place) then heals from it. Collective over each replicate group: every rank of
the generation calls `plan` and, when the snapshot came through, `share`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PeerPlan:
    group: Any  # the replicate group's ProcessGroup
    ranks: list[int]  # its global ranks, which hold the same shards
    source: int  # the global rank that reads the snapshot and sends it

    def reads(self, rank: int) -> bool:
        return rank == self.source


def plan(trainer: Any, in_place: bool) -> PeerPlan | None:
    """The replicate group of this rank and who reads for it (the lowest rank that kept its trainer, else
    the lowest rank); None where the layout has no replicas."""
    dims = trainer.dims
    if trainer.mesh is None or dims.dp_replicate < 2 or dims.pp_enabled:
        return None
    sub = dims.get_mesh(trainer.mesh, "dp_replicate")
    group = sub.get_group()
    ranks = [int(r) for r in sub.mesh.flatten().tolist()]
    kept: list[bool] = [False] * len(ranks)
    dist.all_gather_object(kept, bool(in_place), group=group)
    source = next((r for r, k in zip(ranks, kept, strict=True) if k), ranks[0])
    return PeerPlan(group, ranks, source)


def _slots(state: dict[Any, Any], path: str = "") -> list[tuple[str, dict[Any, Any], Any]]:
    """(path, dict, key) of every leaf, in sorted key order (the same on every rank of one layout)."""
    out: list[tuple[str, dict[Any, Any], Any]] = []
    for k in sorted(state, key=str):
        v = state[k]
        out += _slots(v, f"{path}/{k}") if isinstance(v, dict) else [(f"{path}/{k}", state, k)]
    return out


def _local(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def share(state: dict[str, Any], p: PeerPlan, rank: int) -> int:
    """The source's `state` (restored) to the other ranks' `state` (theirs, to be loaded), in place:
    tensors by broadcast, the rest (step, scheduler, data position) as one object. Returns the bytes."""
    slots = _slots(state)
    tensors = [(path, _local(d[k])) for path, d, k in slots if isinstance(d[k], torch.Tensor)]
    others = [(d, k) for _, d, k in slots if not isinstance(d[k], torch.Tensor)]
    names = [[path for path, _ in tensors]]
    dist.broadcast_object_list(names, src=p.source, group=p.group)
    if names[0] != [path for path, _ in tensors]:
        raise RuntimeError("peer heal: the replicas' states differ in their entries; restore from the keepers")
    nbytes = 0
    for _, t in tensors:
        buf = t if t.is_contiguous() else t.contiguous()
        dist.broadcast(buf, src=p.source, group=p.group)
        if buf is not t:
            t.copy_(buf)
        nbytes += buf.numel() * buf.element_size()
    box = [[d[k] for d, k in others]]
    dist.broadcast_object_list(box, src=p.source, group=p.group)
    if rank != p.source:
        for (d, k), v in zip(others, box[0], strict=True):
            d[k] = v
    return nbytes
