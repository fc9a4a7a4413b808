"""A throwaway PostgreSQL server from Debian's packages: initdb in a temporary directory,
loopback only, stopped (by its own pid file) when done. Used by the tests and the benchmarks."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _bin(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))[::-1]), None
    )
    if not found:
        raise RuntimeError(
            f"PostgreSQL's {name} is not installed (scripts/setup installs postgresql)"
        )
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(argv: list[str]) -> list[str]:
    return argv if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--", *argv]


@contextmanager
def postgres_server(*settings: str) -> Iterator[str]:
    """Yields the URL of a fresh server's `postgres` database (user `fleet`, trust auth)."""
    root = Path(tempfile.mkdtemp(prefix="fleet-pg-"))
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        os.chown(root, pw.pw_uid, pw.pw_gid)
    data = root / "data"
    port = _free_port()
    subprocess.run(
        _as_postgres([_bin("initdb"), "-D", str(data), "-A", "trust", "-U", "fleet", "-E", "UTF8"]),
        check=True,
        capture_output=True,
    )
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c max_connections=200"
    for setting in settings:
        options += f" -c {setting}"
    subprocess.run(
        _as_postgres(
            [_bin("pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-o", options, "-w", "start"]
        ),
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://fleet@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            _as_postgres([_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
            check=False,
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)


def create_database(server_url: str) -> str:
    """A new empty database on the server; returns its URL."""
    import psycopg

    name = "t_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server_url.rsplit("/", 1)[0] + "/" + name


def drop_database(server_url: str, url: str) -> None:
    import psycopg

    name = url.rsplit("/", 1)[1]
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
