"""alembic's environment for the ledger: runs revisions on the connection fleet hands it.

fleet runs migrations itself (`fleet.ledger.migrations.migrate`, on every open, inside one
transaction holding PostgreSQL's advisory lock); the `alembic` command works too, with the
database given as `-x url=...` (scripts/test runs `alembic check` that way).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine
from sqlmodel import SQLModel

import fleet.ledger.tables  # noqa: F401  (the tables, registered on SQLModel's metadata)
from fleet.ledger.migrations import compared

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=SQLModel.metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters by copying
        compare_type=True,
        include_object=compared,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise SystemExit("give the ledger's database: alembic -x url=sqlite:///PATH ...")
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
