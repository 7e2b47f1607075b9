"""The snapshot's staging plan is reused only while the state holds the very same tensors."""

from __future__ import annotations

import torch

from checkpointing.memory_storage import StagingPlan, flatten


def _state() -> dict:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {"model": dict(model.state_dict()), "optim": {"state": opt.state_dict()["state"]}, "step": 7}


def _update(plan: StagingPlan, state: dict) -> bool:
    return plan.update(state, flatten(state)[0])


def test_a_plan_is_kept_while_the_tensors_are_the_same_and_redone_when_one_changes() -> None:
    state = _state()
    plan = StagingPlan()
    assert _update(plan, state) is True  # planned
    sources = plan.sources
    state["step"] = 8  # a non-tensor value changes every step: it goes into the extras, not the plan
    assert _update(plan, state) is False and plan.sources is sources

    weight = state["model"]["weight"]
    weight.mul_(2)  # updated in place (what an optimizer step does): the same plan sees the new values
    assert _update(plan, state) is False
    copied = [s.clone() for s in plan.sources]
    assert any(torch.equal(c, weight) for c in copied)

    weight.data = torch.zeros(3, 4)  # new storage under the same object: resolved again
    assert _update(plan, state) is False and plan.sources is not sources
    assert any(s.data_ptr() == weight.data_ptr() for s in plan.sources)

    sources = plan.sources
    state["model"]["weight"] = weight.detach().clone()  # another object, same shape: same layout, new sources
    assert _update(plan, state) is False and plan.sources is not sources
    # ... resolved again alone (as the RNG state is, a new tensor every step): the other slots keep theirs
    new_ptr = state["model"]["weight"].data_ptr()
    kept = [a is b for a, b in zip(plan.sources, sources, strict=True)]
    assert kept.count(False) == 1 and plan.sources[kept.index(False)].data_ptr() == new_ptr
    assert _update(plan, state) is False  # and seen as the same from then on
    assert plan.sources[kept.index(False)].data_ptr() == new_ptr

    state["model"]["weight"] = torch.zeros(3, 4, dtype=torch.float64)  # another dtype: a new layout
    assert _update(plan, state) is True
    state["model"]["weight"] = torch.zeros(3, 4)
    assert _update(plan, state) is True

    state["model"]["weight"] = torch.zeros(5, 4)  # another shape: a new layout
    assert _update(plan, state) is True

    state["model"]["extra"] = torch.ones(2)  # another key: a new layout
    assert _update(plan, state) is True
    assert len(plan.sources) == len(plan.layout.slots)
