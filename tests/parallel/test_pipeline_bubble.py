"""The one bubble formula (parallel/planner/timing.py) against torch's own pipeline schedules.

torch builds each schedule as a table of time slots per rank (`pipeline_order`), one action a
slot. The zero-bubble schedules split the backward into input-gradient and weight-gradient
actions, so with every action one slot long (T_F = T_B = T_W, the papers' assumption) the idle
slots over the busy ones of a rank are the schedule's bubble fraction.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel.planner.timing import bubble_fraction


@pytest.fixture
def fake_world() -> Iterator[None]:
    """One process stands for a world of pp ranks (the fake backend): schedules are built, nothing is sent."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _until_last_action(actions: list[object]) -> int:
    n = len(actions)
    while n and actions[n - 1] is None:
        n -= 1
    return n


def _idle_over_busy(schedule: str, pp: int, m: int) -> float:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    cls, ids = {"zero_bubble": (ScheduleInterleavedZeroBubble, [0, pp]),
                "zbv": (ScheduleZBVZeroBubble, [0, 2 * pp - 1])}[schedule]
    stages = [PipelineStage(nn.Linear(4, 4), s, 2 * pp, torch.device("cpu")) for s in ids]
    order = cls(stages, n_microbatches=m, loss_fn=lambda out, _target: out.sum()).pipeline_order
    dist.destroy_process_group()
    slots = max(_until_last_action(acts) for acts in order.values())
    busy = {r: sum(a is not None for a in acts) for r, acts in order.items()}
    assert len(set(busy.values())) == 1, busy  # every rank does the same work
    return (slots - busy[0]) / busy[0]


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv"])
@pytest.mark.parametrize(("pp", "m"), [(2, 8), (4, 8), (4, 16)])
def test_zero_bubble_is_a_third_of_the_interleaved_bubble(fake_world: None, schedule: str, pp: int, m: int) -> None:
    assert _idle_over_busy(schedule, pp, m) == pytest.approx(bubble_fraction(schedule, pp, m, 2))
    assert bubble_fraction(schedule, pp, m, 2) == pytest.approx(bubble_fraction("interleaved_1f1b", pp, m, 2) / 3)
