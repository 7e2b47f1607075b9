"""service.supervisor.pauses: a re-form's pause of training, from the rows the reporter writes."""

from __future__ import annotations

import math
from typing import Any

from service.supervisor.pauses import OTHER, Pause, PauseClock


def _row(step: int, gen: int, end: float, step_s: float = 0.25, dp: int = 4) -> dict[str, Any]:
    return {"step": step, "generation": gen, "end_time": end, "step_time_s": step_s, "dp": dp}


def test_a_pause_is_the_gap_between_generations_less_the_first_steps_own_time() -> None:
    clock = PauseClock()
    clock.formed_for(1, "worker_died")
    assert clock.rows([_row(1, 0, 10.0), _row(2, 0, 10.25)]) == []  # no re-form, no pause
    # Generation 1's first step ended 1.1 s after generation 0's last (10.25 -> 11.35), and took 0.3 s of it.
    (got,) = clock.rows([_row(3, 1, 11.35, 0.3, dp=3), _row(4, 1, 11.6, dp=3)])
    assert (got.generation, got.cause, got.dp, got.step) == (1, "worker_died", 3, 3) and abs(got.seconds - 0.8) < 1e-9
    clock.formed_for(2, "growth")
    (got,) = clock.rows([_row(5, 2, 12.4)])
    assert (got.generation, got.cause, got.dp, got.step) == (2, "growth", 4, 5) and abs(got.seconds - 0.55) < 1e-9


def test_an_interrupted_recovery_names_the_generation_that_completed_a_step() -> None:
    clock = PauseClock()
    clock.rows([_row(1, 0, 10.0)])
    clock.formed_for(1, "worker_died")  # cut short before its first step
    clock.formed_for(2, "node_died")
    assert [p.cause for p in clock.rows([_row(2, 2, 12.0)])] == ["node_died"]
    clock.formed_for(3, "growth")  # (and generation 1's cause is not left behind for a later one)
    assert [p.cause for p in clock.rows([_row(3, 3, 13.0)])] == ["growth"]


def test_an_unnamed_generation_and_rows_without_times() -> None:
    clock = PauseClock()
    assert clock.rows([_row(1, 0, 10.0), _row(2, 1, 9.0)]) == [Pause(1, OTHER, 0.0, 4, 2)]  # clocks: never below 0
    assert clock.rows([{"step": 3, "generation": 2}]) == []  # no times: no figure rather than a wrong one
    assert clock.rows([{"step": 4}]) == []


def test_a_re_form_lasts_until_its_generation_completes_a_step() -> None:
    """What holds new workers' start-ups back (service.supervisor.generations): a re-form runs from its
    launch to its generation's first row, whatever its cause; none runs before the first launch."""
    clock = PauseClock()
    assert clock.reforming_for() == math.inf
    clock.rows([_row(1, 0, 10.0)])
    assert clock.reforming_for() == math.inf  # generation 0's start is not a re-form
    for gen, cause in ((1, "worker_died"), (2, "growth")):
        clock.formed_for(gen, cause)
        assert 0 <= clock.reforming_for() < 1.0
        clock.rows([_row(2 * gen, gen - 1, 10.0 + gen)])  # a late row of the generation before: still re-forming
        assert clock.reforming_for() < 1.0
        clock.rows([_row(2 * gen + 1, gen, 10.5 + gen)])
        assert clock.reforming_for() == math.inf
