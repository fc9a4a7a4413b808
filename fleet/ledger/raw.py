"""The ledger's one way to run SQL: `Raw`, a transaction's DBAPI cursor running the named
statements of `fleet.ledger.queries`."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from fleet.core.lifecycle import WorkItemState

QUEUED, LEASED, DONE = (s.value for s in WorkItemState)
"""Work items' states, as the SQL holds them (`fleet.core.lifecycle.WorkItemState`)."""

MARKS = "{marks}"
"""Where a statement takes a list of values (`IN ({marks})`): `n=len(values)` fills it in."""

_ROW_LOCKS = re.compile(r" FOR UPDATE( SKIP LOCKED)?")
_NOTHING_TO_PIPE = contextlib.nullcontext()


@lru_cache(maxsize=512)
def dialect(sql: str, postgres: bool, n: int) -> str:
    """A statement as one backend runs it: `?` placeholders (`%s` on PostgreSQL, a literal `%`
    doubled), `{marks}` as `n` of them; row locks kept on PostgreSQL, dropped on SQLite, where
    a write transaction holds the whole database from BEGIN IMMEDIATE on."""
    if n:
        sql = sql.replace(MARKS, ",".join("?" * n))
    elif MARKS in sql:
        raise ValueError(f"a statement that takes a list was given none: {sql[:60]!r}")
    if postgres:
        return sql.replace("%", "%%").replace("?", "%s")
    return _ROW_LOCKS.sub("", sql)


class Raw:
    """A transaction's DBAPI cursor, and the only thing in the ledger that runs SQL.

    Skipping SQLAlchemy's statement compilation and parameter processing is most of the per-row
    cost of the hot paths (measured with cProfile: ~70% of a claim+complete before this); the
    statements are strings, written once, for both backends (see `dialect`).
    """

    def __init__(self, cursor: Any, postgres: bool) -> None:
        self._cur = cursor
        self.postgres = postgres

    def _execute(self, sql: str, params: Sequence[Any], n: int) -> None:
        self._cur.execute(dialect(sql, self.postgres, n), params)

    def all(self, sql: str, params: Sequence[Any] = (), *, n: int = 0) -> list[Any]:
        """Every row of a query (`n`: how many values fill `{marks}`)."""
        self._execute(sql, params, n)
        return list(self._cur.fetchall())

    def all_in(self, sql: str, values: Sequence[Any], chunk: int = 500) -> list[Any]:
        """Every row of a query whose `IN ({marks})` takes `values`, `chunk` at a time (a
        statement's bound values are limited)."""
        rows: list[Any] = []
        for start in range(0, len(values), chunk):
            part = values[start : start + chunk]
            rows += self.all(sql, part, n=len(part))
        return rows

    def one(self, sql: str, params: Sequence[Any] = (), *, n: int = 0) -> Any:
        """A query's first row, or None."""
        self._execute(sql, params, n)
        return self._cur.fetchone()

    def value(self, sql: str, params: Sequence[Any] = (), *, n: int = 0) -> Any:
        """The first column of a query's one row (a count, a sum)."""
        self._execute(sql, params, n)
        return self._cur.fetchone()[0]

    def run(self, sql: str, params: Sequence[Any] = (), *, n: int = 0) -> int:
        """Runs one statement; how many rows it changed."""
        self._execute(sql, params, n)
        return int(self._cur.rowcount)

    def pipeline(self) -> contextlib.AbstractContextManager[Any]:
        """Statements whose results are not read (`many`), sent one after another without
        waiting for each: on PostgreSQL a psycopg pipeline, answered (and any error raised) at
        the end of the block, so the server runs one while the next is prepared (a claim's or
        a completion's four or five row writes: 13% more claim+complete jobs/s from the
        statements alone, measured). SQLite runs in this process: nothing to wait for."""
        if self.postgres:
            return self._cur.connection.pipeline()  # type: ignore[no-any-return]
        return _NOTHING_TO_PIPE

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Runs one statement once per row of values (nothing for none)."""
        if rows:
            self._cur.executemany(dialect(sql, self.postgres, 0), rows)
