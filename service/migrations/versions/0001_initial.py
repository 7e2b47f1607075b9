"""The first schema: jobs, events, metrics, logs, checkpoints, tokens.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("seq", BigId, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(32), nullable=False, unique=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text()),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.Column("spec_public", sa.Text(), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("idempotency_key", sa.String(255)),
        sa.Column("min_world", sa.Integer(), nullable=False),
        sa.Column("max_world", sa.Integer()),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("admitted_at", sa.Float()),
        sa.Column("started_at", sa.Float()),
        sa.Column("finished_at", sa.Float()),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("recoveries", sa.Integer(), nullable=False),
        sa.Column("progress", sa.JSON()),
        sa.UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
    )
    op.create_index("ix_jobs_owner_seq", "jobs", ["owner", "seq"])
    op.create_index("ix_jobs_status_seq", "jobs", ["status", "seq"])
    op.create_index("ix_jobs_name_seq", "jobs", ["name", "seq"])

    op.create_table(
        "events",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON()),
    )
    op.create_index("ix_events_job_id_id", "events", ["job_id", "id"])

    op.create_table(
        "metrics",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
    )
    op.create_index("ix_metrics_job_id_step", "metrics", ["job_id", "step"])

    op.create_table(
        "logs",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
    )
    op.create_index("ix_logs_job_id_id", "logs", ["job_id", "id"])

    op.create_table(
        "checkpoints",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("data", sa.JSON()),
    )
    op.create_index("ix_checkpoints_job_id_step", "checkpoints", ["job_id", "step"])

    op.create_table(
        "tokens",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("principal", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("label", sa.String(128)),
        sa.Column("created_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    for table in ("tokens", "checkpoints", "logs", "metrics", "events", "jobs"):
        op.drop_table(table)
