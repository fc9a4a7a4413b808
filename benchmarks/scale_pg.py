"""PostgreSQL for `benchmarks.scale`: a throwaway server on loopback (Debian's packages, initdb
in a temporary directory, stopped by its own pid file), and the database's own counters read
before and after each phase of the run.

The server is the test suite's recipe (`tests/pgserver.py`: its binaries, port and user), with
its data directory kept in reach so that its postmaster's CPU can be read.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from benchmarks.harness import stat_cpu_s
from tests.pgserver import _as_postgres, _bin, _free_port


@dataclasses.dataclass(frozen=True)
class PgServer:
    url: str
    """Its `postgres` database (user `fleet`, trust authentication, loopback only)."""
    data: Path

    @property
    def pid(self) -> int:
        """The postmaster's pid (the first line of its pid file)."""
        return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])


@contextmanager
def postgres_server(max_connections: int = 200) -> Iterator[PgServer]:
    """A fresh server, stopped (immediate mode) and removed when done."""
    root = Path(tempfile.mkdtemp(prefix="fleet-bench-pg-"))
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    data = root / "data"
    port = _free_port()
    subprocess.run(
        _as_postgres([_bin("initdb"), "-D", str(data), "-A", "trust", "-U", "fleet", "-E", "UTF8"]),
        check=True, capture_output=True,
    )  # fmt: skip
    options = (
        f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c max_connections={max_connections}"
    )
    try:
        subprocess.run(
            _as_postgres([_bin("pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-o",
                          options, "-w", "start"]),
            check=True, capture_output=True,
        )  # fmt: skip
        yield PgServer(f"postgresql://fleet@127.0.0.1:{port}/postgres", data)
    finally:
        subprocess.run(
            _as_postgres([_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
            check=False, capture_output=True,
        )  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds the process `pid` and its live children have used (PostgreSQL's postmaster
    and its backends: one process per connection, kept open by the servers' pools)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            ppid = int(text.rsplit(")", 1)[1].split()[1])
            if ppid == pid or int(stat.parent.name) == pid:
                total += stat_cpu_s(stat)
        except (OSError, ValueError, IndexError):
            continue  # (ended meanwhile)
    return total


@dataclasses.dataclass(frozen=True)
class PgCounters:
    """The database's cumulative counters at one moment (`pg_stat_database`,
    `pg_stat_user_tables`): every transaction committed, every row inserted, updated or deleted
    in fleet's tables."""

    commits: int
    inserted: int
    updated: int
    deleted: int

    @property
    def row_writes(self) -> int:
        return self.inserted + self.updated + self.deleted

    def __sub__(self, other: PgCounters) -> PgCounters:
        return PgCounters(self.commits - other.commits, self.inserted - other.inserted,
                          self.updated - other.updated, self.deleted - other.deleted)  # fmt: skip


def counters(url: str) -> PgCounters:
    """The counters now. Backends publish theirs at most once a second while busy, so a
    reading lags the work by about that much; phases last many seconds."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        tuples = conn.execute(
            "SELECT coalesce(sum(n_tup_ins), 0), coalesce(sum(n_tup_upd), 0), "
            "coalesce(sum(n_tup_del), 0) FROM pg_stat_user_tables"
        ).fetchone()
    assert row is not None and tuples is not None
    return PgCounters(int(row[0]), int(tuples[0]), int(tuples[1]), int(tuples[2]))
