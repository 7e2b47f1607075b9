"""Tokens expire and are revoked (the row stays); an audit log of every mutating request.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("expires_at", sa.Float()))
        batch.add_column(sa.Column("revoked_at", sa.Float()))
        batch.add_column(sa.Column("created_by", sa.String(128)))
    op.create_table(
        "audit",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("principal", sa.String(128), nullable=False),
        sa.Column("client", sa.String(64)),
        sa.Column("method", sa.String(16), nullable=False),
        sa.Column("path", sa.String(512), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
    )
    op.create_index("ix_audit_principal_id", "audit", ["principal", "id"])


def downgrade() -> None:
    op.drop_index("ix_audit_principal_id", "audit")
    op.drop_table("audit")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("created_by")
        batch.drop_column("revoked_at")
        batch.drop_column("expires_at")
