"""A worker's start-up work at a low CPU priority.

A worker that starts while others train (a replacement after a failure, a spare, a grow-back) imports
torch and our engine and warms up: about 2 CPU-seconds. Where its node's cores are busy with training
(CPU training, or host threads feeding GPUs), that time came out of the training ranks' steps. Run at a
nice of STARTUP_NICE, it gets the cores the ranks leave idle and little more, so it starts later but the
job trains on at full speed meanwhile; on an idle node it starts as fast as before.

Linux's nice is per thread and cannot be undone without privileges, so the work runs in a short-lived
thread of its own: the threads that train later (created elsewhere, at the usual priority) are not
affected, and none is created from the low-priority thread except its own passing ones.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
STARTUP_NICE = 10  # CFS weight 110 against a training rank's 1024: ~10% of a core a busy rank leaves it


def lower_this_thread(by: int = STARTUP_NICE) -> bool:
    """Raise the calling thread's nice value by `by` (Linux only: elsewhere setpriority's id is a
    process's, never a thread's). Returns whether it did."""
    if not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:
        return False
    return True


def at_low_priority(fn: Callable[[], T], name: str = "startup") -> T:
    """fn() on a fresh thread at STARTUP_NICE more than now; waits for it and returns (or raises) its result."""
    out: list[T] = []
    err: list[BaseException] = []

    def body() -> None:
        lower_this_thread()
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            err.append(e)

    t = threading.Thread(target=body, name=f"{name}-low-priority", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]
