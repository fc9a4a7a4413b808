"""work items that must run on a namespace-isolated host

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-09 09:00:00.000000

Frozen once landed: a later change to the tables is a new revision, never an edit of this one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A machine started from a parked session's layer (an overlay upper directory) can only be
    # made by the namespace runtime: such work is claimable by namespace hosts alone, as work
    # that needs a VM is by VM hosts alone.
    op.add_column(
        "work_items",
        sa.Column("needs_namespace", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_column("work_items", "needs_namespace")
