"""Real fleet processes for crash tests: servers and agents we start, and end by pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import REPO

FLEET = [sys.executable, "-m", "fleet.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    log: Path

    def kill9(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill9()


@dataclass
class Procs:
    """Everything a test started, ended at teardown (by pid, never by name)."""

    root: Path
    started: list[Proc] = field(default_factory=list)

    def spawn(self, name: str, *args: str) -> Proc:
        log = self.root / f"{name}.log"
        with log.open("w") as out:  # the child holds its own copy of the descriptor
            popen = subprocess.Popen(
                [*FLEET, *args],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, "FLEET_SERVER": ""},
            )
        proc = Proc(name, popen, log)
        self.started.append(proc)
        return proc

    def server(self, name: str, db: str, port: int, *extra: str) -> Proc:
        proc = self.spawn(
            name,
            "--log-level",
            "warning",
            "serve",
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            db,
            *extra,
        )
        deadline = time.monotonic() + 30
        while "listening on" not in proc.log.read_text():
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{name} did not start: {proc.log.read_text()}")
            time.sleep(0.05)
        return proc

    def agent(
        self,
        host_id: str,
        server: str,
        machines: Path,
        slots: int = 4,
        host_class: str = "cpu",
        *extra: str,
    ) -> Proc:
        return self.spawn(
            host_id,
            "--log-level",
            "warning",
            "agent",
            "--class",
            host_class,
            "--runtime",
            "namespace",
            "--server",
            server,
            "--slots",
            str(slots),
            "--host-id",
            host_id,
            "--machines-dir",
            str(machines),
            *extra,
        )

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop()
