"""Schema versions, applied in order, once, under a lock; a newer schema than known is refused.

Each migration is a function of a connection inside the migrating transaction. Version 1 is
the initial schema. A later change to the tables adds a new numbered step here (ALTER TABLE
and the like) and never edits an applied one.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from sqlalchemy import Connection, inspect, text
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

from fleet.core.errors import FailedPrecondition
from fleet.ledger import tables
from fleet.ledger.tables import CHECKPOINT_ROW_BYTES

log = structlog.get_logger(__name__)

_LOCK_KEY = 0x666C656574  # "fleet": serializes replicas migrating one PostgreSQL database


def _initial(conn: Connection) -> None:
    SQLModel.metadata.create_all(conn)


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


def _identity(conn: Connection) -> None:
    for table in (tables.JoinTokenRow, tables.ApiKeyRow, tables.HostIdentityRow):
        table.__table__.create(conn, checkfirst=True)  # type: ignore[union-attr]


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


MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (
        1,
        "initial schema: manifests, rollouts, work items, attempts, hosts, events, artifacts",
        _initial,
    ),
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
LATEST = MIGRATIONS[-1][0]
assert LATEST == tables.SCHEMA_VERSION


def migrate(engine: Engine) -> int:
    """Brings the database to the latest schema; returns the version it is at."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _LOCK_KEY})
        tables.SchemaInfo.__table__.create(conn, checkfirst=True)  # type: ignore[attr-defined]
        row = conn.execute(text("SELECT version FROM schema_info WHERE id = 1")).first()
        current = int(row[0]) if row else 0
        if current > LATEST:
            raise FailedPrecondition(
                f"the ledger's schema is version {current}, newer than this fleet knows "
                f"({LATEST}); upgrade fleet before serving this database"
            )
        for version, name, step in MIGRATIONS:
            if version <= current:
                continue
            step(conn)
            if current == 0:
                conn.execute(
                    text("INSERT INTO schema_info (id, version) VALUES (1, :v)"), {"v": version}
                )
            else:
                conn.execute(
                    text("UPDATE schema_info SET version = :v WHERE id = 1"), {"v": version}
                )
            log.info("ledger_migrated", version=version, name=name)
            current = version
        return current
