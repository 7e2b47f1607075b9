"""The job store: jobs, their events, metrics, logs and checkpoints, and API tokens.

SQLAlchemy over SQLite (default, `sqlite:///path`) or PostgreSQL (`postgresql+psycopg://...`).
The schema is created and upgraded by Alembic when a store opens (service/migrations).

Two kinds of caller: the API (create, read, list, delete, cancel) and each job's supervisor,
which reports from inside a Ray actor through add_event / set_status / add_metrics /
add_checkpoint / add_logs. Terminal statuses are final: a late write never moves a finished job.

Writes retry while the database is unreachable (a PostgreSQL restart): the supervisor's and the
scheduler's for `write_retry_s`, the API's for `api_write_retry_s` (then the API answers 503). The
database plumbing is in store_engine.py; tokens and the audit log in token_store.py, logs in
log_store.py (JobStore has them);
the scheduler's leader lease in leader_lease.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from service.log_store import LOG_MARKER_SOURCE, MAX_LOG_LINE_CHARS, MAX_LOG_LINES, LogRecord, LogTables  # noqa: F401
from service.models import CheckpointRow, Event, Job, LogLine, MetricRow, Token
from service.spec import spec_to_private_json  # the one revealer of secrets; the supervisor imports it here
from service.statuses import ACTIVE, PENDING, RECOVERING, STATUSES, TERMINAL
from service.store_engine import (  # noqa: F401 - the store's plumbing, re-exported for its callers
    MIGRATIONS_DIR,
    decode_cursor,
    encode_cursor,
    json_safe,
    make_engine,
    migrate,
    new_job_id,
    retried,
    store_unavailable,
)
from service.token_store import AuditRecord, TokenRecord, TokenTables  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

class StoreError(Exception):
    """Base of the store's refusals."""


class JobNotFoundError(StoreError, KeyError):
    def __str__(self) -> str:
        return f"no job {self.args[0]!r}"


class JobNotTerminalError(StoreError):
    """Deleting a job that may still run."""


class IdempotencyConflictError(StoreError):
    """The same Idempotency-Key was used before with a different spec."""


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    owner: str
    status: str
    reason: str | None
    priority: int
    spec: dict[str, Any] | None  # public (secrets masked); None in lists, which do not read it
    min_world: int
    max_world: int | None
    created_at: float
    updated_at: float
    admitted_at: float | None
    started_at: float | None
    finished_at: float | None
    cancel_requested: bool
    recoveries: int
    progress: dict[str, Any] | None
    seq: int = field(repr=False, default=0)
    target_dp: int | None = None  # the dp the scheduler asked the job to run at (None: not decided)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True)
class EventRecord:
    id: int
    job_id: str
    ts: float
    kind: str
    message: str
    data: dict[str, Any] | None


@dataclass(frozen=True)
class CheckpointRecord:
    step: int
    uri: str
    tier: str
    ts: float
    data: dict[str, Any] | None


# How long a write keeps retrying while the database is unreachable (a PostgreSQL restart, a failover):
# the supervisor's and scheduler's writes wait out a restart; the API's give up sooner and answer 503.
WRITE_RETRY_S = 120.0
API_WRITE_RETRY_S = 3.0
RETRY_AFTER_S = 2  # what a 503 tells clients to wait


# Lists read no spec: a page of 50 then costs no JSON parsing of specs.
_SUMMARY_COLS = [c for c in Job.__table__.c if c.name not in ("spec_json", "spec_public", "spec_hash")]
_DETAIL_COLS = [*_SUMMARY_COLS, Job.__table__.c.spec_public]


def _job_record(row: Any) -> JobRecord:
    public = getattr(row, "spec_public", None)
    return JobRecord(
        id=row.id,
        name=row.name,
        owner=row.owner,
        status=row.status,
        reason=row.reason,
        priority=row.priority,
        spec=None if public is None else json.loads(public),
        min_world=row.min_world,
        max_world=row.max_world,
        created_at=row.created_at,
        updated_at=row.updated_at,
        admitted_at=row.admitted_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        cancel_requested=bool(row.cancel_requested),
        recoveries=row.recoveries,
        progress=row.progress,
        seq=row.seq,
        target_dp=getattr(row, "target_dp", None),
    )


class JobStore(TokenTables, LogTables):
    """All reads and writes of job state. Safe to share between threads; one per process."""

    def __init__(
        self,
        url: str,
        *,
        run_migrations: bool = True,
        max_log_lines: int = MAX_LOG_LINES,
        write_retry_s: float = WRITE_RETRY_S,
        api_write_retry_s: float = API_WRITE_RETRY_S,
    ) -> None:
        if max_log_lines < 2:
            raise ValueError(f"max_log_lines={max_log_lines} must be at least 2 (a line and the marker)")
        self.url = url
        self.max_log_lines = max_log_lines
        self.write_retry_s = write_retry_s
        self.api_write_retry_s = api_write_retry_s
        self.engine = make_engine(url)
        if run_migrations:
            migrate(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    # ---- the supervisor's side -------------------------------------------------------------

    def _job_exists(self, conn: Any, job_id: str) -> bool:
        return conn.execute(select(Job.seq).where(Job.id == job_id)).first() is not None

    @retried("write_retry_s")
    def add_event(self, job_id: str, kind: str, message: str, data: dict | None = None) -> None:
        with self.engine.begin() as conn:
            if not self._job_exists(conn, job_id):
                log.warning("event %r for unknown job %s dropped", kind, job_id)
                return
            conn.execute(
                insert(Event).values(
                    job_id=job_id, ts=time.time(), kind=kind[:64], message=message,
                    data=json_safe(data) if data else None,
                )
            )

    @retried("write_retry_s")
    def set_status(self, job_id: str, status: str, reason: str | None = None) -> None:
        """Move a job to `status`; a terminal job never moves again. Records a `status` event."""
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        now = time.time()
        values: dict[str, Any] = {"status": status, "updated_at": now}
        if reason is not None or status in TERMINAL:
            values["reason"] = reason
        if status in ACTIVE:
            values["started_at"] = func.coalesce(Job.started_at, now)
        if status == RECOVERING:
            values["recoveries"] = Job.recoveries + 1
        if status in TERMINAL:
            values["finished_at"] = now
        with self.engine.begin() as conn:
            res = conn.execute(
                update(Job)
                .where(Job.id == job_id, Job.status.not_in(TERMINAL), Job.status != status)
                .values(**values)
            )
            if res.rowcount == 0:
                if not self._job_exists(conn, job_id):
                    log.warning("status %s for unknown job %s dropped", status, job_id)
                return
            msg = status if reason is None else f"{status}: {reason}"
            conn.execute(insert(Event).values(job_id=job_id, ts=now, kind="status", message=msg,
                                              data={"status": status, "reason": reason}))

    @retried("write_retry_s")
    def add_metrics(self, job_id: str, rows: list[dict]) -> None:
        """One row a step (step, loss, tokens, dp, world_size, generation, step_time_s, tokens_per_s, ...)."""
        if not rows:
            return
        now = time.time()
        clean = [json_safe(dict(r)) for r in rows]
        for r in clean:
            if not isinstance(r.get("step"), int):
                raise ValueError(f"every metrics row needs an integer 'step'; got {r.get('step')!r}")
        latest = max(clean, key=lambda r: r["step"])
        with self.engine.begin() as conn:
            row = conn.execute(select(Job.progress).where(Job.id == job_id)).first()
            if row is None:
                log.warning("metrics for unknown job %s dropped", job_id)
                return
            conn.execute(insert(MetricRow), [{"job_id": job_id, "step": r["step"], "ts": now, "data": r}
                                             for r in clean])
            prev = row[0] or {}
            if latest["step"] >= int(prev.get("step", -1)):
                conn.execute(update(Job).where(Job.id == job_id).values(progress={**prev, **latest}))

    @retried("write_retry_s")
    def add_checkpoint(self, job_id: str, step: int, uri: str, tier: str, data: dict | None = None) -> None:
        with self.engine.begin() as conn:
            if not self._job_exists(conn, job_id):
                log.warning("checkpoint for unknown job %s dropped", job_id)
                return
            conn.execute(insert(CheckpointRow).values(
                job_id=job_id, step=int(step), uri=uri, tier=tier, ts=time.time(),
                data=json_safe(data) if data else None,
            ))

    # ---- the API's side --------------------------------------------------------------------

    def create_job(
        self,
        spec: Any,
        owner: str,
        *,
        min_world: int,
        max_world: int | None,
        idempotency_key: str | None = None,
    ) -> tuple[JobRecord, bool]:
        """Store a validated spec as a PENDING job. Returns (job, created).

        With an idempotency key already used by this owner: the same spec returns the stored job
        (created=False); a different spec raises IdempotencyConflictError.
        """
        spec_json = spec_to_private_json(spec)
        spec_hash = hashlib.sha256(spec_json.encode()).hexdigest()
        if idempotency_key is not None:
            found = self._by_idempotency_key(owner, idempotency_key, spec_hash)
            if found is not None:
                return found, False
        job_id = new_job_id()
        try:
            self._insert_job(job_id, spec, spec_json, spec_hash, owner, min_world, max_world, idempotency_key)
        except IntegrityError:
            # A concurrent request with the same key won the race.
            if idempotency_key is not None:
                found = self._by_idempotency_key(owner, idempotency_key, spec_hash)
                if found is not None:
                    return found, False
            raise
        job = self.get_job(job_id)
        assert job is not None
        return job, True

    @retried("api_write_retry_s")
    def _insert_job(self, job_id: str, spec: Any, spec_json: str, spec_hash: str, owner: str, min_world: int,
                    max_world: int | None, idempotency_key: str | None) -> None:
        now = time.time()
        if self.get_job(job_id) is not None:
            return  # a retry after a commit whose answer the lost connection swallowed
        with self.engine.begin() as conn:
            conn.execute(insert(Job).values(
                id=job_id, name=spec.name, owner=owner, status=PENDING, reason=None,
                priority=spec.priority, spec_json=spec_json, spec_public=json.dumps(spec.public_dict()),
                spec_hash=spec_hash,
                idempotency_key=idempotency_key, min_world=min_world, max_world=max_world,
                created_at=now, updated_at=now, cancel_requested=False, recoveries=0,
                progress={"total_steps": spec.training.steps},
            ))
            conn.execute(insert(Event).values(
                job_id=job_id, ts=now, kind="submitted", message=f"submitted by {owner}",
                data={"min_world": min_world, "max_world": max_world, "priority": spec.priority},
            ))

    def _by_idempotency_key(self, owner: str, key: str, spec_hash: str) -> JobRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(*_DETAIL_COLS, Job.spec_hash).where(Job.owner == owner, Job.idempotency_key == key)
            ).first()
        if row is None:
            return None
        if row.spec_hash != spec_hash:
            raise IdempotencyConflictError(
                f"Idempotency-Key {key!r} was used for job {row.id} with a different spec; "
                "use a new key for a new job"
            )
        return _job_record(row)

    def get_job(self, job_id: str) -> JobRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(*_DETAIL_COLS).where(Job.id == job_id)).first()
        return None if row is None else _job_record(row)

    def get_spec(self, job_id: str) -> Any:
        """The job's full JobSpec, secrets included (for the supervisor, never for a response)."""
        from service.spec import JobSpec

        with self.engine.connect() as conn:
            row = conn.execute(select(Job.spec_json).where(Job.id == job_id)).first()
        if row is None:
            raise JobNotFoundError(job_id)
        return JobSpec.model_validate_json(row[0])

    def list_jobs(
        self,
        *,
        owner: str | None = None,
        status: Sequence[str] | None = None,
        name: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> tuple[list[JobRecord], str | None]:
        """Newest first. Returns (page, next_cursor); next_cursor is None on the last page."""
        q = select(*_SUMMARY_COLS)
        if owner is not None:
            q = q.where(Job.owner == owner)
        if status:
            statuses = list(status)
            q = q.where(Job.status == statuses[0] if len(statuses) == 1 else Job.status.in_(statuses))
        if name is not None:
            q = q.where(Job.name == name)
        if cursor:
            q = q.where(Job.seq < decode_cursor(cursor))
        q = q.order_by(Job.seq.desc()).limit(limit + 1)
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
        page = [_job_record(r) for r in rows[:limit]]
        nxt = encode_cursor(page[-1].seq) if len(rows) > limit and page else None
        return page, nxt

    @retried("api_write_retry_s")
    def delete_job(self, job_id: str) -> None:
        """Delete a finished job and everything recorded about it."""
        with self.engine.begin() as conn:
            row = conn.execute(select(Job.status).where(Job.id == job_id)).first()
            if row is None:
                raise JobNotFoundError(job_id)
            if row[0] not in TERMINAL:
                raise JobNotTerminalError(
                    f"job {job_id} is {row[0]}; cancel it and wait for CANCELLED before deleting"
                )
            for table in (Event, MetricRow, LogLine, CheckpointRow):
                conn.execute(delete(table).where(table.job_id == job_id))
            conn.execute(delete(Job).where(Job.id == job_id))

    @retried("api_write_retry_s")
    def request_cancel(self, job_id: str) -> JobRecord:
        """Mark that cancellation was asked for (the scheduler or supervisor acts on it)."""
        with self.engine.begin() as conn:
            res = conn.execute(
                update(Job)
                .where(Job.id == job_id, Job.status.not_in(TERMINAL), Job.cancel_requested.is_(False))
                .values(cancel_requested=True, updated_at=time.time())
            )
            if res.rowcount:
                conn.execute(insert(Event).values(job_id=job_id, ts=time.time(), kind="cancel_requested",
                                                  message="cancellation requested", data=None))
        job = self.get_job(job_id)
        if job is None:
            raise JobNotFoundError(job_id)
        return job

    def events(self, job_id: str, after_id: int = 0, limit: int = 1000) -> list[EventRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(Event.__table__).where(Event.job_id == job_id, Event.id > after_id).order_by(Event.id).limit(limit)
            ).all()
        return [EventRecord(r.id, r.job_id, r.ts, r.kind, r.message, r.data) for r in rows]

    def metrics(self, job_id: str, after_step: int = -1, limit: int = 10000) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(MetricRow.data)
                .where(MetricRow.job_id == job_id, MetricRow.step > after_step)
                .order_by(MetricRow.step, MetricRow.id)
                .limit(limit)
            ).all()
        return [r[0] for r in rows]

    def checkpoints(self, job_id: str) -> list[CheckpointRecord]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(CheckpointRow.__table__).where(CheckpointRow.job_id == job_id)
                .order_by(CheckpointRow.step, CheckpointRow.id)
            ).all()
        return [CheckpointRecord(r.step, r.uri, r.tier, r.ts, r.data) for r in rows]

    # ---- the scheduler's side --------------------------------------------------------------

    def queued_jobs(self) -> list[JobRecord]:
        """PENDING jobs not yet admitted: highest priority first, then oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(*_SUMMARY_COLS).where(Job.status == PENDING, Job.admitted_at.is_(None))
                .order_by(Job.priority.desc(), Job.seq)
            ).all()
        return [_job_record(r) for r in rows]

    def admitted_jobs(self) -> list[JobRecord]:
        """Jobs handed to a supervisor (or reported running by one) and not finished."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(*_DETAIL_COLS)
                .where(or_(Job.admitted_at.is_not(None), Job.status.in_(ACTIVE)), Job.status.not_in(TERMINAL))
                .order_by(Job.seq)
            ).all()
        return [_job_record(r) for r in rows]

    @retried("write_retry_s")
    def mark_admitted(self, job_id: str) -> bool:
        """PENDING and not yet admitted → admitted; False if someone else got there (or it was cancelled)."""
        now = time.time()
        with self.engine.begin() as conn:
            res = conn.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == PENDING, Job.admitted_at.is_(None),
                       Job.cancel_requested.is_(False))
                .values(admitted_at=now, updated_at=now)
            )
            if res.rowcount:
                conn.execute(insert(Event).values(job_id=job_id, ts=now, kind="admitted",
                                                  message="admitted by the scheduler", data=None))
            return bool(res.rowcount)

    @retried("write_retry_s")
    def set_target_dp(self, job_id: str, dp: int) -> None:
        """The dp the scheduler asked an admitted job to run at (what `list` shows beside its dp now)."""
        with self.engine.begin() as conn:
            conn.execute(update(Job).where(Job.id == job_id).values(target_dp=int(dp)))

    def owner_weights(self) -> dict[str, float]:
        """Fair-share weight by owner: the largest weight among the owner's valid tokens (default 1)."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(Token.principal, func.max(Token.weight)).where(
                    Token.revoked_at.is_(None), or_(Token.expires_at.is_(None), Token.expires_at > time.time()))
                .group_by(Token.principal)
            ).all()
        return {str(p): float(w) for p, w in rows if w is not None}

    def count_by_status(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(Job.status, func.count()).group_by(Job.status)).all()
        out = dict.fromkeys(STATUSES, 0)
        out.update({s: int(n) for s, n in rows})
        return out

    def queue_length(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(
                select(func.count()).select_from(Job).where(Job.status == PENDING, Job.admitted_at.is_(None))
            ).scalar_one())

    # ---- the scheduler's leader lease ----------------------------------------------------------

    def leader_lease(self, key: int = 74281954) -> Any:
        """The lease one scheduler among several API processes holds (see LeaderLease)."""
        from service.leader_lease import LeaderLease

        return LeaderLease(self.engine, key)
