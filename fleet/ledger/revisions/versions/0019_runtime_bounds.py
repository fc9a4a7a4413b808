"""join tokens and enrolled hosts carry the runtimes they may claim

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-04 21:00:00.000000

Frozen once landed: a later change to the tables is a new revision, never an edit of this one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A token made before this allowed any runtime; it now allows the default (namespace),
    # as a token made without --runtime does. An enrolled host's "" keeps it to the runtime
    # it enrolled with, which is all it could register with before.
    op.add_column(
        "join_tokens",
        sa.Column("runtimes", sa.String(), server_default="namespace", nullable=False),
    )
    op.add_column(
        "host_identities",
        sa.Column("runtimes", sa.String(), server_default="", nullable=False),
    )


def downgrade() -> None:
    with op.batch_alter_table("host_identities") as batch_op:
        batch_op.drop_column("runtimes")
    with op.batch_alter_table("join_tokens") as batch_op:
        batch_op.drop_column("runtimes")
