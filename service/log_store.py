"""The job store's log table: a job's output lines, bounded per job (the oldest dropped first, one marker
line saying how many), and the reads of them."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, or_, select

from service.models import Job, LogLine
from service.store_engine import retried

# Logs are bounded per job: MAX_LOG_LINES lines (the oldest dropped first) of MAX_LOG_LINE_CHARS each.
MAX_LOG_LINES = 50_000
MAX_LOG_LINE_CHARS = 8192
LOG_MARKER_SOURCE = "unbroken"
_MARKER_COUNT = re.compile(r"^(\d+) older log lines dropped")


@dataclass(frozen=True)
class LogRecord:
    id: int
    ts: float
    line: str
    source: str | None = None


def _cut_line(line: str) -> str:
    line = line.rstrip("\n")
    if len(line) <= MAX_LOG_LINE_CHARS:
        return line
    return f"{line[:MAX_LOG_LINE_CHARS]}... ({len(line) - MAX_LOG_LINE_CHARS} more characters cut)"


class LogTables:
    """A job's log lines; JobStore has them (it supplies `engine`, `max_log_lines` and `write_retry_s`)."""

    engine: Any
    max_log_lines: int
    write_retry_s: float

    @retried("write_retry_s")
    def add_log(self, job_id: str, lines: list[str], source: str | None = None) -> None:
        """Lines from one source, stamped now (see add_logs)."""
        now = time.time()
        self.add_logs(job_id, [(now, source, x) for x in lines])

    @retried("write_retry_s")
    def add_logs(self, job_id: str, lines: Sequence[tuple[float, str | None, str]]) -> None:
        """Append (ts, source, line) rows in their order. A line longer than MAX_LOG_LINE_CHARS is cut;
        beyond `max_log_lines` a job keeps its newest lines and one marker line, first, saying how
        many older ones were dropped. Lines for an unknown job are dropped."""
        if not lines:
            return
        rows = [{"job_id": job_id, "ts": float(ts), "source": None if src is None else str(src)[:64],
                 "line": _cut_line(str(line))} for ts, src, line in lines]
        with self.engine.begin() as conn:
            # Locks the job's row on PostgreSQL, so one writer at a time trims its logs.
            if conn.execute(select(Job.seq).where(Job.id == job_id).with_for_update()).first() is None:
                return
            conn.execute(insert(LogLine), rows)
            self._trim_logs(conn, job_id)

    def _trim_logs(self, conn: Any, job_id: str) -> None:
        keep = self.max_log_lines - 1  # and the marker
        cut = conn.execute(select(LogLine.id, LogLine.ts).where(LogLine.job_id == job_id)
                           .order_by(LogLine.id.desc()).offset(keep).limit(1)).first()
        if cut is None:
            return
        old = LogLine.job_id == job_id, LogLine.id <= cut.id
        dropped = conn.execute(select(func.count()).select_from(LogLine)
                               .where(*old, or_(LogLine.source.is_(None), LogLine.source != LOG_MARKER_SOURCE))
                               ).scalar_one()
        for (text,) in conn.execute(select(LogLine.line).where(*old, LogLine.source == LOG_MARKER_SOURCE)):
            m = _MARKER_COUNT.match(text)
            dropped += int(m.group(1)) if m else 0
        conn.execute(delete(LogLine).where(*old))
        # The marker takes the newest dropped line's id, so it reads first and a follower behind it sees it.
        conn.execute(insert(LogLine).values(
            id=cut.id, job_id=job_id, ts=cut.ts, source=LOG_MARKER_SOURCE,
            line=f"{dropped} older log lines dropped: a job keeps its newest {self.max_log_lines} lines",
        ))

    def logs(self, job_id: str, after_id: int = 0, limit: int = 1000) -> list[LogRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(LogLine.__table__).where(LogLine.job_id == job_id, LogLine.id > after_id).order_by(LogLine.id)
                .limit(limit)
            ).all()
        return [LogRecord(r.id, r.ts, r.line, r.source) for r in rows]

    def newest_log_times(self, job_id: str) -> dict[str, float]:
        """{source: time of its newest line} of a job's logs (a supervisor that takes over asks its workers
        for the lines after these: Worker.lines_after). Unnamed sources are left out."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(LogLine.source, func.max(LogLine.ts)).where(
                LogLine.job_id == job_id, LogLine.source.is_not(None)).group_by(LogLine.source)).all()
        return {str(src): float(ts) for src, ts in rows}
