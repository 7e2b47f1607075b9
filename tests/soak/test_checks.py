"""The soak's judge on events as a job writes them: a node loss seen first as the broken collective it
causes is that fault's row, and a supervisor kill's lost steps count from the step the workers reached."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.soak.checks import match_events, table
from tests.soak.schedule import Fault


@dataclass
class Ev:
    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    ts: float = 0.0


def test_a_node_loss_seen_as_a_broken_collective_is_linked_to_it() -> None:
    faults = [Fault("kill_node", 24, 1)]
    events = [
        Ev("failure_detected", "worker-1 (rank 0): RuntimeError: Connection closed by peer",
           {"kind": "collective_error", "step": 24}),
        Ev("recovered", "Recovered from a broken collective", {"total_s": 3.0, "lost_steps": 0}),
    ]
    rows = match_events(faults, {}, events, [])
    assert len(rows) == 1, table(rows)  # no "(not injected)" row for the collective error
    assert rows[0].ok and rows[0].detected.startswith("collective_error"), table(rows)
    assert rows[0].lost == 0 and rows[0].recovery_s == 3.0
    # A collective error far from the node loss's step is not taken for it.
    far = [Ev("failure_detected", "broken", {"kind": "collective_error", "step": 40})]
    rows = match_events(faults, {}, far, [])
    assert not rows[0].ok and rows[1].fault.kind == "(not injected)", table(rows)


def test_a_supervisor_kill_counts_lost_steps_from_the_step_the_workers_reached() -> None:
    faults = [Fault("kill_worker", 8, 0), Fault("kill_supervisor@recovery", 8, 0)]
    events = [
        Ev("failure_detected", "Rank 0 was stopped by chaos (kill_worker before step 9).",
           {"kind": "worker_died", "step": 8}),
        Ev("supervisor_restarted", "the supervisor restarted"),
        Ev("adopted", "found 2 live worker(s)", {"step": 30}),
        Ev("generation", "Generation 2 starts", {"restore": {"generation": 1, "step": 27}}),
        Ev("recovered", "Recovered from a restart of the supervisor",
           {"kind": "supervisor_restarted", "total_s": 4.0, "lost_steps": 3}),
    ]
    rows = match_events(faults, {1: (8, "SIGKILLed the supervisor")}, events, [])
    sup = rows[1]
    assert sup.ok and sup.lost == 3 and sup.recovery_s == 4.0, table(rows)  # not 8 - 27 < 0
    assert "its recovery was cut short" in rows[0].note, table(rows)


def test_a_node_lost_while_the_supervisor_was_down_is_found_in_the_adoption() -> None:
    # The kill_node took its process before its log line was sent, and no supervisor saw it: the
    # restarted one found rank 1 (and the node's other rank) gone.
    faults = [Fault("kill_supervisor", 102, 0), Fault("kill_node", 114, 1)]
    adopted = Ev("adopted", "found 2 live worker(s) of generation 6, which had reached step 114; rank(s) 1, 3 of "
                 "it died while the supervisor was down", {"step": 114, "lost_ranks": [1, 3]})
    events = [Ev("supervisor_restarted", "the supervisor restarted"), adopted,
              Ev("recovered", "Recovered from a restart of the supervisor",
                 {"kind": "supervisor_restarted", "total_s": 9.0, "lost_steps": 0})]
    rows = match_events(faults, {}, events, [])
    assert rows[1].ok and rows[1].detected.startswith("adopted: rank(s) 1, 3"), table(rows)
    # Another rank's loss, or one found before the fault's step, is not this fault.
    for data in ({"step": 114, "lost_ranks": [0]}, {"step": 110, "lost_ranks": [1]}):
        other = [Ev("supervisor_restarted", "x"), Ev("adopted", "found", data)]
        assert not match_events(faults, {}, other, [])[1].ok


def test_a_keeper_killed_while_the_supervisor_was_down_counts_when_it_fired_unwatched() -> None:
    faults = [Fault("kill_keeper", 380, 1)]
    logs = ["chaos: kill_keeper fires on rank 1 before step 381"]
    adopted = Ev("adopted", "found 3 live worker(s)", {"step": 382, "rows_recovered": 33})
    rows = match_events(faults, {}, [Ev("supervisor_restarted", "x"), adopted], logs)
    assert rows[0].ok and "acted while the supervisor restarted" in rows[0].detected, table(rows)
    # Fired while a supervisor ran (outside the adoption's window) and never told: not found.
    early = Ev("adopted", "found 3 live worker(s)", {"step": 382, "rows_recovered": 1})
    assert not match_events(faults, {}, [early], logs)[0].ok
