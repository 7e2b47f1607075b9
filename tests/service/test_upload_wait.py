"""The rule by which a resize's pause waits for a persistent save (service.supervisor.generations)."""

from __future__ import annotations

from service.supervisor.upload_wait import upload_in_the_way


def test_a_save_uploading_now_is_waited_for() -> None:
    assert upload_in_the_way(10, 1, [20, 20, 20], seen=21, target=23) == 20
    assert upload_in_the_way(10, 0, [20], seen=21, target=30) == 20  # without snapshots too


def test_a_save_that_starts_before_the_pause_is_waited_for_when_the_saves_leave_room() -> None:
    assert upload_in_the_way(10, 1, [], seen=19, target=21) == 20  # step 20's save would be uploading
    assert upload_in_the_way(10, 1, [], seen=18, target=20) == 20  # a pause at the save's own step
    assert upload_in_the_way(10, 1, [], seen=20, target=22) is None  # it started already and ended
    assert upload_in_the_way(10, 1, [], seen=21, target=23) is None
    assert upload_in_the_way(2, 1, [], seen=19, target=21) is None  # a save every 2 steps: no room to wait for
    assert upload_in_the_way(0, 1, [], seen=19, target=21) is None  # no persistent saves


def test_without_snapshots_the_pause_is_at_a_save_on_purpose() -> None:
    # in_memory_every 0: the pause target is a persist step; the next generation restores that save
    assert upload_in_the_way(10, 0, [], seen=18, target=20) is None
