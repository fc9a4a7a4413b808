"""baseline: the schema of version 14

Revision ID: 0014
Revises: (none: databases from before it are brought to version 14 by fleet's legacy steps,
then stamped with it)
Create Date: 2026-12-02 04:56:52.727208

Frozen once landed: a later change to the tables is a new revision, never an edit of this one.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("secret_hash", sa.String(), nullable=False),
        sa.Column("tenant", sa.String(), nullable=False),
        sa.Column("scopes", sa.String(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=True),
        sa.Column("last_used_at", sa.Float(), nullable=True),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_keys_tenant"), ["tenant"], unique=False)

    op.create_table(
        "artifacts",
        sa.Column("digest", sa.String(), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("digest"),
    )
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("work_id", sa.String(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.String(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("outcome", sa.String(), nullable=False),
        sa.Column("error", sa.String(), nullable=False),
        sa.Column("cpu_s", sa.Float(), server_default="0", nullable=False),
        sa.Column("peak_memory_mib", sa.Float(), server_default="0", nullable=False),
        sa.Column("device_s", sa.Float(), server_default="0", nullable=False),
        sa.Column("artifact_failed", sa.Boolean(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_attempts_ended_at"), ["ended_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_attempts_work_id"), ["work_id"], unique=False)

    op.create_table(
        "checkpoint_usage",
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("rollout_id"),
    )
    op.create_table(
        "checkpoints",
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("rollout_id", "seq"),
    )
    op.create_table(
        "egress_events",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("machine", sa.String(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("destination", sa.String(), nullable=False),
        sa.Column("decision", sa.String(), nullable=False),
        sa.Column("reason", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("egress_events", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_egress_events_rollout_id"), ["rollout_id"], unique=False
        )

    op.create_table(
        "events",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("from_state", sa.String(), nullable=False),
        sa.Column("to_state", sa.String(), nullable=False),
        sa.Column("actor", sa.String(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("message", sa.String(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_events_rollout_id"), ["rollout_id"], unique=False)

    op.create_table(
        "host_identities",
        sa.Column("host_id", sa.String(), nullable=False),
        sa.Column("host_class", sa.String(), nullable=False),
        sa.Column("labels_json", sa.String(), nullable=False),
        sa.Column("capabilities_json", sa.String(), nullable=False),
        sa.Column("token_id", sa.String(), nullable=False),
        sa.Column("enrolled_at", sa.Float(), nullable=False),
        sa.Column("cert_serial", sa.String(), nullable=False),
        sa.Column("cert_expires_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("host_id"),
    )
    op.create_table(
        "hosts",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("host_class", sa.String(), nullable=False),
        sa.Column("capabilities_json", sa.String(), nullable=False),
        sa.Column("registered_at", sa.Float(), nullable=False),
        sa.Column("last_heartbeat_at", sa.Float(), nullable=False),
        sa.Column("state", sa.String(), server_default="ready", nullable=False),
        sa.Column("drain_deadline", sa.Float(), nullable=True),
        sa.Column("images_json", sa.String(), server_default="[]", nullable=False),
        sa.Column("drain_by", sa.String(), server_default="", nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "join_tokens",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("secret_hash", sa.String(), nullable=False),
        sa.Column("host_class", sa.String(), nullable=False),
        sa.Column("labels_json", sa.String(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("uses_left", sa.Integer(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "manifests",
        sa.Column("digest", sa.String(), nullable=False),
        sa.Column("body", sa.String(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("digest"),
    )
    op.create_table(
        "pool_events",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("pool", sa.String(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(), nullable=False),
        sa.Column("cap", sa.Integer(), nullable=False),
        sa.Column("message", sa.String(), nullable=False),
        sa.Column("figures_json", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
    )
    with op.batch_alter_table("pool_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_pool_events_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_pool_events_pool"), ["pool"], unique=False)

    op.create_table(
        "pools",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("host_class", sa.String(), nullable=False),
        sa.Column("labels_json", sa.String(), nullable=False),
        sa.Column("max_running", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("gates_json", sa.String(), server_default="{}", nullable=False),
        sa.Column("adaptive_json", sa.String(), server_default="", nullable=False),
        sa.Column("control_json", sa.String(), server_default="{}", nullable=False),
        sa.Column("paused_at", sa.Float(), nullable=True),
        sa.Column("paused_why", sa.String(), server_default="", nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "schema_info",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "settings",
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("value_json", sa.String(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key"),
    )
    op.create_table(
        "work_items",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("tenant", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("host_class", sa.String(), nullable=False),
        sa.Column("needs_vm", sa.Boolean(), nullable=False),
        sa.Column("needs_cuda_device", sa.Boolean(), nullable=False),
        sa.Column("needs_inference", sa.Boolean(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("not_before", sa.Float(), nullable=False),
        sa.Column("deadline", sa.Float(), nullable=False),
        sa.Column("lease_owner", sa.String(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("lease_expires_at", sa.Float(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("result_fingerprint", sa.String(), nullable=False),
        sa.Column("claim_request_id", sa.String(), nullable=False),
        sa.Column("avoid_host", sa.String(), server_default="", nullable=False),
        sa.Column("pin_host", sa.String(), server_default="", nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_work_items_rollout_id"), ["rollout_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_work_items_state"), ["state"], unique=False)
        batch_op.create_index(batch_op.f("ix_work_items_tenant"), ["tenant"], unique=False)

    op.create_table(
        "rollouts",
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("idempotency_key", sa.String(), nullable=False),
        sa.Column("request_fingerprint", sa.String(), nullable=False),
        sa.Column("manifest_digest", sa.String(), nullable=False),
        sa.Column("tenant", sa.String(), nullable=False),
        sa.Column("labels_json", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.String(), nullable=False),
        sa.Column("host_id", sa.String(), nullable=False),
        sa.Column("runtime", sa.String(), nullable=False),
        sa.Column("device", sa.String(), nullable=False),
        sa.Column("results_json", sa.String(), nullable=False),
        sa.Column("egress_json", sa.String(), nullable=False),
        sa.Column("cpu_s", sa.Float(), nullable=False),
        sa.Column("outputs_json", sa.String(), server_default="[]", nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["manifest_digest"],
            ["manifests.digest"],
        ),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("idempotency_key"),
    )
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rollouts_id"), ["id"], unique=True)
        batch_op.create_index(batch_op.f("ix_rollouts_state"), ["state"], unique=False)

    op.create_table(
        "rollout_labels",
        sa.Column("rollout_id", sa.String(), nullable=False),
        sa.Column("key", sa.String(), nullable=False),
        sa.Column("value", sa.String(), nullable=False),
        sa.ForeignKeyConstraint(
            ["rollout_id"],
            ["rollouts.id"],
        ),
        sa.PrimaryKeyConstraint("rollout_id", "key"),
    )
    with op.batch_alter_table("rollout_labels", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rollout_labels_value"), ["value"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("rollout_labels", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollout_labels_value"))

    op.drop_table("rollout_labels")
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollouts_state"))
        batch_op.drop_index(batch_op.f("ix_rollouts_id"))

    op.drop_table("rollouts")
    with op.batch_alter_table("work_items", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_work_items_tenant"))
        batch_op.drop_index(batch_op.f("ix_work_items_state"))
        batch_op.drop_index(batch_op.f("ix_work_items_rollout_id"))

    op.drop_table("work_items")
    op.drop_table("settings")
    op.drop_table("schema_info")
    op.drop_table("pools")
    with op.batch_alter_table("pool_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_pool_events_pool"))
        batch_op.drop_index(batch_op.f("ix_pool_events_at"))

    op.drop_table("pool_events")
    op.drop_table("manifests")
    op.drop_table("join_tokens")
    op.drop_table("hosts")
    op.drop_table("host_identities")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_events_rollout_id"))

    op.drop_table("events")
    with op.batch_alter_table("egress_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_egress_events_rollout_id"))

    op.drop_table("egress_events")
    op.drop_table("checkpoints")
    op.drop_table("checkpoint_usage")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_attempts_work_id"))
        batch_op.drop_index(batch_op.f("ix_attempts_ended_at"))

    op.drop_table("attempts")
    op.drop_table("artifacts")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_tenant"))

    op.drop_table("api_keys")
