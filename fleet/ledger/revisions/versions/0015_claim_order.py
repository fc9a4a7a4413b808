"""claims scan queued work in lease order

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02 05:03:48.154511

Frozen once landed: a later change to the tables is a new revision, never an edit of this one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A claim reads the first queued items in lease order instead of sorting all of them.
    # (autogenerate cannot compare an index with a DESC column: written by hand.)
    op.create_index(
        "ix_work_items_claim",
        "work_items",
        ["state", sa.text("priority DESC"), "not_before", "id"],
        unique=False,
    )
    op.drop_index("ix_work_items_state", table_name="work_items")


def downgrade() -> None:
    op.create_index("ix_work_items_state", "work_items", ["state"], unique=False)
    op.drop_index("ix_work_items_claim", table_name="work_items")
