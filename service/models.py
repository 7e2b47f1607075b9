"""The job store's tables (SQLAlchemy 2 declarative). The Alembic revisions in
service/migrations/versions create exactly these; change both together.

Times are UNIX seconds (float) so SQLite and PostgreSQL store them alike. There are no foreign
keys: the store deletes a job's rows itself, and a late write for a deleted job is dropped.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a 64-bit identity.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    seq: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(32), unique=True, nullable=False)
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    owner: Mapped[str] = mapped_column(String(128), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    reason: Mapped[str | None] = mapped_column(Text)
    priority: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    spec_json: Mapped[str] = mapped_column(Text, nullable=False)  # full spec, secrets included
    spec_public: Mapped[str] = mapped_column(Text, nullable=False)  # secrets masked: what the API returns
    spec_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    min_world: Mapped[int] = mapped_column(Integer, nullable=False)
    max_world: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    updated_at: Mapped[float] = mapped_column(Float, nullable=False)
    admitted_at: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    recoveries: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    target_dp: Mapped[int | None] = mapped_column(Integer)  # the scheduler's: the dp it asked the job to run at

    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        Index("ix_jobs_owner_seq", "owner", "seq"),
        Index("ix_jobs_status_seq", "status", "seq"),
        Index("ix_jobs_name_seq", "name", "seq"),
    )


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(32), nullable=False)
    ts: Mapped[float] = mapped_column(Float, nullable=False)
    kind: Mapped[str] = mapped_column(String(64), nullable=False)
    message: Mapped[str] = mapped_column(Text, nullable=False)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    __table_args__ = (Index("ix_events_job_id_id", "job_id", "id"),)


class MetricRow(Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(32), nullable=False)
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    ts: Mapped[float] = mapped_column(Float, nullable=False)
    data: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)

    __table_args__ = (Index("ix_metrics_job_id_step", "job_id", "step"),)


class LogLine(Base):
    __tablename__ = "logs"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(32), nullable=False)
    ts: Mapped[float] = mapped_column(Float, nullable=False)
    source: Mapped[str | None] = mapped_column(String(64))  # "rank 3", "supervisor", ...; None: unnamed
    line: Mapped[str] = mapped_column(Text, nullable=False)

    __table_args__ = (Index("ix_logs_job_id_id", "job_id", "id"),)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(32), nullable=False)
    step: Mapped[int] = mapped_column(Integer, nullable=False)
    uri: Mapped[str] = mapped_column(Text, nullable=False)
    tier: Mapped[str] = mapped_column(String(32), nullable=False)
    ts: Mapped[float] = mapped_column(Float, nullable=False)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    __table_args__ = (Index("ix_checkpoints_job_id_step", "job_id", "step"),)


class Token(Base):
    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, nullable=False)
    principal: Mapped[str] = mapped_column(String(128), nullable=False)
    role: Mapped[str] = mapped_column(String(16), nullable=False)
    label: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float, nullable=False)
    expires_at: Mapped[float | None] = mapped_column(Float)  # None: never expires
    revoked_at: Mapped[float | None] = mapped_column(Float)  # set by revocation; the row stays for the audit
    created_by: Mapped[str | None] = mapped_column(String(128))
    weight: Mapped[float] = mapped_column(Float, nullable=False, default=1.0, server_default="1")  # fair share


class AuditEntry(Base):
    """One mutating request: who (principal or "-" when unauthenticated), what, when, outcome."""

    __tablename__ = "audit"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[float] = mapped_column(Float, nullable=False)
    principal: Mapped[str] = mapped_column(String(128), nullable=False)
    client: Mapped[str | None] = mapped_column(String(64))
    method: Mapped[str] = mapped_column(String(16), nullable=False)
    path: Mapped[str] = mapped_column(String(512), nullable=False)
    status: Mapped[int] = mapped_column(Integer, nullable=False)

    __table_args__ = (Index("ix_audit_principal_id", "principal", "id"),)
