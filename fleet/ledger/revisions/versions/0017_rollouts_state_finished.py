"""rollouts indexed by state and when they finished

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02 18:40:00.000000

Frozen once landed: a later change to the tables is a new revision, never an edit of this one.
"""

from __future__ import annotations

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The metrics count what finished in the last minute: with state alone they read every
    # rollout that ever reached that state (110 ms at 50,000), with this the recent ones.
    op.create_index(
        "ix_rollouts_state_finished", "rollouts", ["state", "finished_at"], unique=False
    )
    op.drop_index("ix_rollouts_state", table_name="rollouts")


def downgrade() -> None:
    op.create_index("ix_rollouts_state", "rollouts", ["state"], unique=False)
    op.drop_index("ix_rollouts_state_finished", table_name="rollouts")
