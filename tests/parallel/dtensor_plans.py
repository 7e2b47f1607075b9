"""What the local-shard tests (optimizer step, gradient clip) share: a small FSDP model and a count of the
foreach and other ops DTensor plans from cold, as after a re-form (its caches reset)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def fsdp_model(seed: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # 5 rows over 2 ranks: uneven shards; a 1-D bias (the no-decay group).
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    return model


@contextlib.contextmanager
def planned_ops() -> Iterator[list[str]]:
    """The ops DTensor plans inside the block, with its caches reset at the start, as a new mesh starts."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    from parallel import dist as pdist

    planned: list[str] = []
    plan = ShardingPropagator.propagate_op_sharding_non_cached

    def counting(self: Any, op_schema: Any) -> Any:
        planned.append(str(op_schema.op))
        return plan(self, op_schema)

    ShardingPropagator.propagate_op_sharding_non_cached = counting
    pdist.reset_dtensor_caches()  # the counting wrapper is what the new cache calls
    try:
        yield planned
    finally:
        ShardingPropagator.propagate_op_sharding_non_cached = plan
