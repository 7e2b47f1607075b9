"""Fair-share weights on tokens (an owner's weight: the largest of its valid tokens'), and the
scheduler's target data-parallel degree of each admitted job.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("weight", sa.Float(), nullable=False, server_default="1"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("target_dp", sa.Integer()))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("target_dp")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("weight")
