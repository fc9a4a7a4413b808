"""How a ledger reaches its database: SQLite's file, pragmas and engine, PostgreSQL's engine,
and the errors either raises when another writer stored the same key first."""

from __future__ import annotations

import importlib.util
import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import create_engine

from fleet.core.errors import FailedPrecondition


# A concurrent insert of the same key, from SQLAlchemy or (hot paths) straight from the driver.
def _driver_clashes() -> tuple[type[Exception], ...]:
    """psycopg's own integrity error, where psycopg is installed (the `postgres` extra): the
    hot paths' cursor raises it unwrapped."""
    if importlib.util.find_spec("psycopg") is None:
        return ()
    import psycopg

    return (psycopg.errors.IntegrityError,)


UNIQUE_CLASH: tuple[type[Exception], ...] = (
    IntegrityError,
    sqlite3.IntegrityError,
    *_driver_clashes(),
)


SQLITE_PAGE_BYTES = 2048
"""The page size of a SQLite ledger made new (one made before keeps its own: 4096).

A submission alone in its transaction writes about 16 pages to the log (a row and index entries
in five tables), and its durable commit waits for them. Measured on our machines, 2,048-byte
pages against 4,096: one by one, 2,043 to 2,135 rollouts/s against 1,903 to 1,944 (8 to 10%
more); claims and completions from four hosts unchanged (8,272 to 8,324 against 8,364 to 8,418
jobs/s); 500 per transaction, 8% fewer (10,900 against 11,670 to 12,000 rows/s: more pages per
row). The ledger's transactions are mostly small ones, and each waits for its commit."""


def _sqlite_pragmas(connection: sqlite3.Connection) -> None:
    cursor = connection.cursor()
    # Before anything is written (it takes effect when the file is made, and not after).
    cursor.execute(f"PRAGMA page_size={SQLITE_PAGE_BYTES}")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")  # an acknowledged write survives power loss
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def sqlite_connect(database: str) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are begun explicitly), set up as the
    engine's are."""
    connection = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    _sqlite_pragmas(connection)
    return connection


def sqlite_engine(path: Path) -> Engine:
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(f"sqlite:///{path}", connect_args={"check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" hook below issue BEGIN IMMEDIATE: a writer takes the lock up
        # front instead of failing to upgrade a read lock under contention.
        dbapi_conn.isolation_level = None
        _sqlite_pragmas(dbapi_conn)

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def postgres_engine(url: str) -> Engine:
    if importlib.util.find_spec("psycopg") is None:
        raise FailedPrecondition(
            "a PostgreSQL ledger needs the psycopg driver, which this installation lacks: "
            "pip install 'fleet[postgres]'"
        )
    url = url.replace("postgres://", "postgresql://", 1)
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    # READ COMMITTED with explicit row locks (FOR UPDATE, SKIP LOCKED for claims and sweeps);
    # synchronous_commit stays on: an acknowledged write is on disk.
    return create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=4)
