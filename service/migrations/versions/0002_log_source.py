"""Each log line names where it came from (a rank, the supervisor, the store's own marker).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("logs") as batch:
        batch.add_column(sa.Column("source", sa.String(64)))


def downgrade() -> None:
    with op.batch_alter_table("logs") as batch:
        batch.drop_column("source")
