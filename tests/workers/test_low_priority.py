"""workers.low_priority: start-up work runs on a thread of its own at a higher nice value, which leaves the
calling thread's priority (and so the threads that train later) as it was."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from workers.low_priority import STARTUP_NICE, at_low_priority, lower_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_work_runs_lower_and_the_caller_stays_where_it_was() -> None:
    before = _nice()
    seen = at_low_priority(lambda: (_nice(), threading.get_native_id()))
    assert seen[0] == min(19, before + STARTUP_NICE)
    assert seen[1] != threading.get_native_id()  # not the caller's thread
    assert _nice() == before


def test_an_error_is_raised_in_the_caller() -> None:
    def fails() -> None:
        raise ValueError("bad engine")

    with pytest.raises(ValueError, match="bad engine"):
        at_low_priority(fails)


def test_lowering_stops_at_19() -> None:
    def twice() -> int:
        lower_this_thread(15)
        lower_this_thread(15)
        return _nice()

    assert at_low_priority(twice) == 19
