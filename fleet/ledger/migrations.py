"""The ledger's schema: alembic revisions (`fleet/ledger/revisions/`), applied on every open, in
one transaction, under PostgreSQL's advisory lock; a schema newer than this fleet knows is refused.

Revision 0014, the baseline, is the schema of version 14 written out as frozen DDL; each later
change to the tables is a new revision (`alembic -c fleet/ledger/alembic.ini -x url=... revision
--autogenerate`), never an edit of a landed one, and `scripts/test` runs `alembic check` so that
the tables and the revisions cannot drift apart.

A database made before the baseline carries `schema_info` versions 1 to 13: the legacy steps
below bring it to version 14 (each an ALTER TABLE or a data fill, guarded by what the database
has), then it is stamped with the baseline. They are frozen too. `schema_info` stays, holding the
head revision's number, so that a fleet from before alembic refuses a newer database.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import structlog
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, MetaData, Table, inspect, text
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

from fleet.core.errors import FailedPrecondition
from fleet.ledger import tables
from fleet.ledger.tables import CHECKPOINT_ROW_BYTES

log = structlog.get_logger(__name__)

_LOCK_KEY = 0x666C656574  # "fleet": serializes replicas migrating one PostgreSQL database


def _egress_events(conn: Connection) -> None:
    tables.EgressEventRow.__table__.create(conn, checkfirst=True)  # type: ignore[attr-defined]


def _needs_inference(conn: Connection) -> None:
    tables.CheckpointRow.__table__.create(conn, checkfirst=True)  # type: ignore[attr-defined]
    columns = {c["name"] for c in inspect(conn).get_columns("work_items")}
    if "needs_inference" not in columns:  # a fresh database got it from the initial schema
        conn.execute(
            text("ALTER TABLE work_items ADD COLUMN needs_inference BOOLEAN NOT NULL DEFAULT false")
        )
    if "cpu_s" not in {c["name"] for c in inspect(conn).get_columns("rollouts")}:
        conn.execute(text("ALTER TABLE rollouts ADD COLUMN cpu_s FLOAT NOT NULL DEFAULT 0"))


def _checkpoint_budget(conn: Connection) -> None:
    tables.CheckpointUsageRow.__table__.create(conn, checkfirst=True)  # type: ignore[attr-defined]
    # What the checkpoints already stored hold, charged as new ones are.
    conn.execute(
        text(
            "INSERT INTO checkpoint_usage (rollout_id, bytes) SELECT rollout_id, "
            f"SUM(length(data)) + {int(CHECKPOINT_ROW_BYTES)} * count(*) FROM checkpoints "
            "GROUP BY rollout_id ON CONFLICT (rollout_id) DO NOTHING"
        )
    )


ADDED_AFTER_BASELINE: dict[str, frozenset[str]] = {
    "join_tokens": frozenset({"runtimes"}),  # revision 0019
    "host_identities": frozenset({"runtimes"}),  # revision 0019
}
"""Columns of the legacy tables that revisions after the baseline added: a legacy step creates
those tables without them (their schema-14 form), and the revision adds them."""


def legacy_table(name: str, into: MetaData | None = None) -> Table:
    """The legacy table `name` as schema 14 had it: today's definition less the columns added
    after the baseline."""
    today = SQLModel.metadata.tables[name]
    later = ADDED_AFTER_BASELINE.get(name, frozenset())
    if not later:  # (indexes and all, as today)
        return today.to_metadata(into if into is not None else MetaData())
    return Table(
        name, into if into is not None else MetaData(),
        *(column._copy() for column in today.columns if column.name not in later),
    )  # fmt: skip


def _identity(conn: Connection) -> None:
    for name in ("join_tokens", "api_keys", "host_identities"):
        legacy_table(name).create(conn, checkfirst=True)


def _avoid_host(conn: Connection) -> None:
    if "avoid_host" not in {c["name"] for c in inspect(conn).get_columns("work_items")}:
        conn.execute(
            text("ALTER TABLE work_items ADD COLUMN avoid_host VARCHAR NOT NULL DEFAULT ''")
        )
    if conn.dialect.name == "postgresql":  # SQLite's integers are 64-bit already
        for table in ("work_items", "attempts"):
            conn.execute(text(f"ALTER TABLE {table} ALTER COLUMN fencing_token TYPE BIGINT"))


def _outputs(conn: Connection) -> None:
    if "outputs_json" not in {c["name"] for c in inspect(conn).get_columns("rollouts")}:
        conn.execute(
            text("ALTER TABLE rollouts ADD COLUMN outputs_json VARCHAR NOT NULL DEFAULT '[]'")
        )


def _host_state(conn: Connection) -> None:
    if "state" not in {c["name"] for c in inspect(conn).get_columns("hosts")}:
        conn.execute(text("ALTER TABLE hosts ADD COLUMN state VARCHAR NOT NULL DEFAULT 'ready'"))


def _pin_host(conn: Connection) -> None:
    if "pin_host" not in {c["name"] for c in inspect(conn).get_columns("work_items")}:
        conn.execute(text("ALTER TABLE work_items ADD COLUMN pin_host VARCHAR NOT NULL DEFAULT ''"))


def _drain(conn: Connection) -> None:
    columns = {c["name"] for c in inspect(conn).get_columns("hosts")}
    if "drain_deadline" not in columns:
        conn.execute(text("ALTER TABLE hosts ADD COLUMN drain_deadline FLOAT"))
    if "drain_by" not in columns:
        conn.execute(text("ALTER TABLE hosts ADD COLUMN drain_by VARCHAR NOT NULL DEFAULT ''"))


def _pools(conn: Connection) -> None:
    tables.PoolRow.__table__.create(conn, checkfirst=True)  # type: ignore[attr-defined]


def _settings(conn: Connection) -> None:
    tables.SettingRow.__table__.create(conn, checkfirst=True)  # type: ignore[attr-defined]


def _attempt_resources(conn: Connection) -> None:
    columns = {c["name"] for c in inspect(conn).get_columns("attempts")}
    for name in ("cpu_s", "peak_memory_mib"):
        if name not in columns:
            conn.execute(text(f"ALTER TABLE attempts ADD COLUMN {name} FLOAT NOT NULL DEFAULT 0"))


def _pool_control(conn: Connection) -> None:
    columns = {c["name"] for c in inspect(conn).get_columns("attempts")}
    if "device_s" not in columns:
        conn.execute(text("ALTER TABLE attempts ADD COLUMN device_s FLOAT NOT NULL DEFAULT 0"))
    if "artifact_failed" not in columns:
        conn.execute(
            text("ALTER TABLE attempts ADD COLUMN artifact_failed BOOLEAN NOT NULL DEFAULT false")
        )
    columns = {c["name"] for c in inspect(conn).get_columns("pools")}
    for name, ddl in (
        ("gates_json", "VARCHAR NOT NULL DEFAULT '{}'"),
        ("adaptive_json", "VARCHAR NOT NULL DEFAULT ''"),
        ("control_json", "VARCHAR NOT NULL DEFAULT '{}'"),
        ("paused_at", "FLOAT"),
        ("paused_why", "VARCHAR NOT NULL DEFAULT ''"),
    ):
        if name not in columns:
            conn.execute(text(f"ALTER TABLE pools ADD COLUMN {name} {ddl}"))
    tables.PoolEventRow.__table__.create(conn, checkfirst=True)  # type: ignore[attr-defined]
    if "images_json" not in {c["name"] for c in inspect(conn).get_columns("hosts")}:
        conn.execute(text("ALTER TABLE hosts ADD COLUMN images_json VARCHAR NOT NULL DEFAULT '[]'"))
    # Gates read the attempts that ended in a window, every second.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_attempts_ended_at ON attempts (ended_at)"))


LEGACY: list[tuple[int, str, Callable[[Connection], None]]] = [
    (2, "egress events: refused DNS queries and connections per rollout", _egress_events),
    (
        3,
        "hybrid rollouts: work items that call the gateway, and their checkpoints",
        _needs_inference,
    ),
    (4, "a budget of checkpoint bytes per rollout", _checkpoint_budget),
    (5, "identity: join tokens, tenants' API keys, enrolled and revoked hosts", _identity),
    (6, "a retry goes first to another host; fencing tokens are 64-bit", _avoid_host),
    (7, "rollouts list the output files their final attempt stored", _outputs),
    (8, "hosts can be cordoned: they take no new work", _host_state),
    (9, "a work item may be pinned to one host (a session's fork)", _pin_host),
    (10, "hosts can be drained: leased work runs until a deadline, then is released", _drain),
    (11, "pools: hosts chosen by class and labels, with a cap on what they run", _pools),
    (12, "fleet-wide settings: a rollback to the local pool", _settings),
    (13, "attempts record their machine's CPU seconds and peak memory", _attempt_resources),
    (
        14,
        "pools carry promotion gates and an adaptive cap; attempts record device seconds; hosts "
        "say what images they hold",
        _pool_control,
    ),
]
BASELINE = "0014"
LEGACY_TABLES = frozenset({
    "egress_events", "checkpoints", "checkpoint_usage", "join_tokens", "api_keys",
    "host_identities", "pools", "settings", "pool_events",
})  # fmt: skip
"""The tables legacy steps create whole from today's definitions (`tables`): equal to the
baseline's as long as no revision after it changes them. One that does must first give the step
that table's frozen schema-14 form (a test compares the two)."""
REVISIONS = Path(__file__).with_name("revisions")


HAND_WRITTEN_INDEXES = frozenset({"ix_work_items_claim"})
"""Indexes with a DESC column: alembic cannot read their order back from SQLite, so it would
call them different on every comparison. Their revisions are written by hand, and a test checks
them (the claim's scan uses ix_work_items_claim and sorts nothing)."""


def compared(obj: object, name: str | None, type_: str, reflected: bool, other: object) -> bool:
    """alembic's `include_object`: what `alembic check` compares (all but those indexes)."""
    return not (type_ == "index" and name in HAND_WRITTEN_INDEXES)


def alembic_config(conn: Connection | None = None) -> Config:
    """alembic's configuration for the ledger's revisions (on `conn`, when given)."""
    config = Config()
    config.set_main_option("script_location", str(REVISIONS))
    if conn is not None:
        config.attributes["connection"] = conn
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def _newer(current: object, latest: int) -> FailedPrecondition:
    return FailedPrecondition(
        f"the ledger's schema is version {current}, newer than this fleet knows ({latest}); "
        "upgrade fleet before serving this database"
    )


def migrate(engine: Engine) -> int:
    """Brings the database to the head revision; returns the schema version it is at."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_KEY})
        config = alembic_config(conn)
        script = ScriptDirectory.from_config(config)
        head = script.get_current_head()
        assert head is not None
        latest = int(head)
        have = set(inspect(conn).get_table_names())
        legacy: int | None = None
        if "schema_info" in have:
            row = conn.execute(text("SELECT version FROM schema_info WHERE id = 1")).first()
            legacy = int(row[0]) if row else None
            if legacy is not None and legacy > latest:
                raise _newer(legacy, latest)
        current = MigrationContext.configure(conn).get_current_revision()
        if current is not None:
            if current not in {r.revision for r in script.walk_revisions()}:
                raise _newer(current, latest)
        elif legacy is not None:  # made before the baseline: legacy steps, then the stamp
            for version, name, step in LEGACY:
                if version > legacy:
                    step(conn)
                    log.info("ledger_migrated", version=version, name=name)
            command.stamp(config, BASELINE)
            current = BASELINE
        if current != head:  # (at the head already, as on most opens: nothing to run)
            command.upgrade(config, "head")
            log.info("ledger_migrated", revision=head, applied_after=current or "nothing")
        if legacy is None:
            insert = "INSERT INTO schema_info (id, version) VALUES (1, :v)"
            conn.execute(text(insert), {"v": latest})
        elif legacy != latest:
            conn.execute(text("UPDATE schema_info SET version = :v WHERE id = 1"), {"v": latest})
        return latest
