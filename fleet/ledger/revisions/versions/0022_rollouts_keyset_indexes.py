"""rollouts indexed for keyset pages of one tenant, of one state and of a time window

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-08 09:00:00.000000

Frozen once landed: a later change to the tables is a new revision, never an edit of this one.
"""

from __future__ import annotations

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The console's rollouts list pages newest first by seq, filtered by tenant or by state:
    # without these a rare state (or a small tenant among a million rollouts) walks the whole
    # seq index to fill a page; with them the page reads its own rows only. A window of
    # creation times long ago is found by its own index rather than by walking back to it.
    op.create_index("ix_rollouts_tenant_seq", "rollouts", ["tenant", "seq"], unique=False)
    op.create_index("ix_rollouts_state_seq", "rollouts", ["state", "seq"], unique=False)
    op.create_index("ix_rollouts_created", "rollouts", ["created_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_rollouts_created", table_name="rollouts")
    op.drop_index("ix_rollouts_state_seq", table_name="rollouts")
    op.drop_index("ix_rollouts_tenant_seq", table_name="rollouts")
