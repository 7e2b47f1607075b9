"""Capture of a process's output for its job's logs: what a rank or a supervisor prints, line by line.

The capture works on file descriptors 1 and 2, so it catches what Python prints, what logging
writes, tracebacks, and what native code (gloo, NCCL, Ray's core) writes straight to the fd. Each
line still goes on to where the fd pointed before (Ray's per-actor log files, the dashboard), and is
also kept in a bounded buffer that the owner drains into the job's logs.

Only for processes that belong to one job (Ray actors of the job): it rewires the whole process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque

MAX_BUFFERED_LINES = 5000  # between two drains; older lines are counted and dropped
MAX_LINE_CHARS = 2000


class OutputCapture:
    """Tee fds 1 and 2 into a bounded buffer of (time, stream, line); `drain()` takes what is there."""

    def __init__(self, max_lines: int = MAX_BUFFERED_LINES) -> None:
        self._lines: deque[tuple[float, str, str]] = deque(maxlen=max_lines)
        self._lock = threading.Lock()
        self._dropped = 0
        self._started = False

    def start(self) -> OutputCapture:
        if self._started:
            return self
        self._started = True
        import sys

        for f in (sys.stdout, sys.stderr):  # a line reaches the logs when it is printed, not at exit
            with contextlib.suppress(Exception):
                f.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            original = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            threading.Thread(target=self._pump, args=(read_end, original, stream), name=f"capture-{stream}",
                             daemon=True).start()
        return self

    def _pump(self, read_end: int, original: int, stream: str) -> None:
        """Copy the pipe to the original fd at once, and split it into lines for the buffer.

        It never blocks on anything but the pipe: a stalled reader would stall every print."""
        partial = b""
        while True:
            try:
                chunk = os.read(read_end, 65536)
            except OSError:
                return
            if not chunk:
                return
            with contextlib.suppress(OSError):
                os.write(original, chunk)
            partial += chunk
            *lines, partial = partial.split(b"\n")
            if len(partial) > MAX_LINE_CHARS:  # a very long line without a newline: keep it moving
                lines.append(partial)
                partial = b""
            if lines:
                self._add(stream, lines)

    def _add(self, stream: str, lines: list[bytes]) -> None:
        now = time.time()
        with self._lock:
            for raw in lines:
                text = raw.decode("utf-8", errors="replace").rstrip("\r")
                if not text.strip():
                    continue
                if len(self._lines) == self._lines.maxlen:
                    self._dropped += 1
                self._lines.append((now, stream, text[:MAX_LINE_CHARS]))

    def drain(self) -> list[tuple[float, str, str]]:
        """The lines captured since the last drain, oldest first (with a note of any dropped)."""
        with self._lock:
            out = list(self._lines)
            self._lines.clear()
            dropped, self._dropped = self._dropped, 0
        if dropped:
            out.insert(0, (out[0][0] if out else time.time(), "stderr",
                           f"[unbroken: {dropped} earlier line(s) of output dropped: more than "
                           f"{MAX_BUFFERED_LINES} between two sends]"))
        return out


class SentLines:
    """The newest lines a process sent to its supervisor, with their source (`rank <r>`): a supervisor
    that crashed lost the ones it had not written yet, and the notes sent while it was down; the one
    that takes over asks for those (`after`) as it asks for the metrics rows (Worker.rows_after)."""

    def __init__(self, keep: int = MAX_BUFFERED_LINES) -> None:
        self._lines: deque[tuple[float, str, str, str]] = deque(maxlen=keep)  # (time, stream, line, source)
        self._lock = threading.Lock()

    def add(self, source: str, lines: list[tuple[float, str, str]]) -> None:
        with self._lock:
            self._lines.extend((t, stream, line, source) for t, stream, line in lines)

    def after(self, newest: dict[str, float]) -> list[tuple[float, str, str, str]]:
        """The lines of each source newer than `newest[source]` (the newest the job's logs hold of it;
        every line of a source they lack), oldest first."""
        with self._lock:
            return [x for x in self._lines if x[0] > newest.get(x[3], float("-inf"))]


_CAPTURE: OutputCapture | None = None


def capture_process_output() -> OutputCapture:
    """The process's one capture, started on first use."""
    global _CAPTURE
    if _CAPTURE is None:
        _CAPTURE = OutputCapture().start()
    return _CAPTURE


def echo_logs_to_stdout() -> None:
    """Unbroken's loggers (`unbroken.*`) write INFO lines to stdout, once per process: in a job's actors
    that is the job's logs (through the capture) and Ray's actor log (the dashboard, `ray logs actor`).
    Python's root logger drops INFO, so they get a handler of their own."""
    import logging
    import sys

    logger = logging.getLogger("unbroken")
    if any(getattr(h, "_unbroken_echo", False) for h in logger.handlers):
        return
    h = logging.StreamHandler(sys.stdout)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    h._unbroken_echo = True  # type: ignore[attr-defined]
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    logger.propagate = False
