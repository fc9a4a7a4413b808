"""attempts record the language-model tokens their requests used, in all and by model

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06 12:00:00.000000

Frozen once landed: a later change to the tables is a new revision, never an edit of this one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Attempts made before this used no language model through the gateway: 0 is their count.
    op.add_column(
        "attempts",
        sa.Column("prompt_tokens", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.add_column(
        "attempts",
        sa.Column("completion_tokens", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.create_table(
        "attempt_tokens",
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("attempt_id", "model"),
    )


def downgrade() -> None:
    op.drop_table("attempt_tokens")
    with op.batch_alter_table("attempts") as batch_op:
        batch_op.drop_column("completion_tokens")
        batch_op.drop_column("prompt_tokens")
