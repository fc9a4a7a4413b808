"""`fleet gateway` as an operator starts it: a real process, its model, its endpoints."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


def test_fleet_gateway_without_a_log_level_starts_serves_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    """No --log-level given: the gateway loads its model, says where it listens, and ends
    cleanly when signalled (it used to exit at once on its own settings); its start's heap is
    settled once."""
    env = {**os.environ, "FLEET_HOME": str(tmp_path / "home")}
    argv = [sys.executable, "-m", "fleet.cli.main", "gateway", "--listen", "127.0.0.1:0",
            "--http-listen", "127.0.0.1:0", "--device", "cpu", "--engine", "inline"]  # fmt: skip
    with subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        said = b""
        try:
            until = time.monotonic() + 120
            while b"\n" not in said and proc.poll() is None and time.monotonic() < until:
                ready, _, _ = select.select([proc.stdout], [], [], 1.0)
                if ready:
                    said += os.read(proc.stdout.fileno(), 4096)
            running = proc.poll() is None
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        errors = proc.stderr.read().decode(errors="replace")

    assert running, f"fleet gateway exited at once: {errors[-2000:]}"
    assert said.startswith(b"fleet gateway: gridworld-policy"), said
    assert b"gRPC on port" in said and b"HTTP on port" in said
    assert code == 0, errors[-2000:]
    # Its start's heap (its modules, torch's) is out of the collector's walks (fleet.heap).
    settled = [json.loads(line) for line in errors.splitlines()
               if line.startswith("{") and '"heap_settled"' in line]  # fmt: skip
    assert len(settled) == 1, errors[-2000:]
    assert settled[0]["frozen_objects"] > 100_000
