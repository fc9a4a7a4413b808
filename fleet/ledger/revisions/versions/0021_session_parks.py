"""sessions that park: the rollout holding each parked or resumed session and its layer

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07 12:00:00.000000

Frozen once landed: a later change to the tables is a new revision, never an edit of this one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "session_parks",
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("layer_digest", sa.String(), nullable=False),
        sa.Column("layer_size", sa.BigInteger(), nullable=False),
        sa.Column("parked_from", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("session_id"),
    )
    op.create_index("ix_session_parks_rollout", "session_parks", ["rollout_id"])


def downgrade() -> None:
    op.drop_index("ix_session_parks_rollout", table_name="session_parks")
    op.drop_table("session_parks")
