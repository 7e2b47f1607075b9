"""The soak's schedule: seeded (the same seed, the same faults), every kind when there is room, faults
inside a recovery sharing their host's step, in-job faults as chaos events that fire once per job."""

from __future__ import annotations

import pytest

from service.spec import parse_spec
from tests.soak.schedule import (
    ALL_KINDS,
    JOB_KINDS,
    RECOVERABLE,
    RECOVERY_KINDS,
    job_chaos,
    make_schedule,
    parse_schedule,
)


@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_long_schedule_covers_every_kind(seed: int) -> None:
    faults = make_schedule(seed, steps=400, faults=22, persist_every=25)
    assert faults == make_schedule(seed, steps=400, faults=22, persist_every=25)
    assert len(faults) == 22
    assert {f.kind for f in faults} >= set(ALL_KINDS)
    assert any(f.during_save and f.in_job for f in faults)
    for f in faults:
        assert 0 < f.step < 400
        if f.kind in RECOVERY_KINDS:  # it interrupts the recovery of a worker fault at its step
            assert any(g.step == f.step and g.kind in RECOVERABLE for g in faults)
    # The job's chaos list is a valid spec: each in-job fault once per job (generation: null).
    chaos = job_chaos(faults)
    assert len(chaos) == sum(f.kind in JOB_KINDS for f in faults)
    spec = parse_spec({"training": {"steps": 400}, "chaos": chaos})
    assert all(ev.generation is None for ev in spec.chaos)


def test_short_schedule_mixes_kinds() -> None:
    faults = make_schedule(3, steps=60, faults=5, persist_every=10, min_gap=6)
    assert len(faults) == 5 and len({f.kind for f in faults}) >= 4
    assert any(f.kind in RECOVERY_KINDS for f in faults) and any(f.during_save for f in faults)


def test_schedule_by_hand_and_its_errors() -> None:
    faults = parse_schedule("kill_worker@20:1, kill_keeper@10", persist_every=10)
    assert [(f.kind, f.step, f.rank, f.during_save) for f in faults] == [
        ("kill_keeper", 10, 0, True), ("kill_worker", 20, 1, True)]
    with pytest.raises(ValueError, match="kind@step"):
        parse_schedule("explode@3", persist_every=10)
    with pytest.raises(ValueError, match="do not fit"):
        make_schedule(0, steps=100, faults=22, persist_every=25)
