"""A worker process ends on SIGTERM, as a plain Python process does.

    exit_on_sigterm()   # once, in the worker's process (any thread)

Why: Ray gives its worker processes a Python SIGTERM handler (it raises SystemExit). Python runs a
signal's handler only on the main thread, and in a threaded actor that thread stays inside Ray's C++
task loop, so the handler never runs: a worker told to terminate trained on until its job ended
(12 s in a test job). The kernel's default action ends the process at once; Ray reports the actor dead,
as after a SIGKILL, and the group re-forms without it from the keepers. There is no graceful leave: none
of our code runs on the main thread to start one.
"""

from __future__ import annotations

import ctypes
import signal

__all__ = ["exit_on_sigterm"]


def exit_on_sigterm() -> None:
    """Set SIGTERM's disposition to the default (terminate) for the whole process. Python's
    signal.signal only works on the main thread; libc's signal() works on any."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    previous = libc.signal(int(signal.SIGTERM), None)  # None is SIG_DFL (0)
    if previous == ctypes.c_void_p(-1).value:  # SIG_ERR
        err = ctypes.get_errno()
        raise OSError(err, f"signal(SIGTERM, SIG_DFL) failed: errno {err}")
