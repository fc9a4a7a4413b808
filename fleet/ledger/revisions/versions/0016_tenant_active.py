"""a count of each tenant's active work items, kept as they change

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02 16:00:00.000000

Frozen once landed: a later change to the tables is a new revision, never an edit of this one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenant_active",
        sa.Column("tenant", sa.String(), nullable=False),
        sa.Column("active", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("tenant"),
    )
    # What the database holds now: every queued or leased item, by tenant.
    op.execute(
        "INSERT INTO tenant_active (tenant, active) SELECT tenant, count(*) FROM work_items "
        "WHERE state IN ('QUEUED', 'LEASED') GROUP BY tenant"
    )


def downgrade() -> None:
    op.drop_table("tenant_active")
