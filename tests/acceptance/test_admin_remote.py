"""An operator on another machine administers the fleet with only the server's address, the
CA's certificate and a key of admin scope: its own network namespace, reaching the server
through a veth pair, and its own empty `$FLEET_HOME` (no ledger, no CA key).

Everything runs as a user would run it: `fleet ca init`, `fleet serve` and the bootstrap
`fleet key create --db` on the server's side; `fleet host|key|pool` on the operator's, with
`FLEET_SERVER`, `FLEET_CA` and `FLEET_KEY` only. A tenant's key is refused each of them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.core.placement import HostCapabilities, HostClass, Isolation, RuntimeKind
from fleet.ledger.store import Ledger
from tests.acceptance.procs import Procs, free_port
from tests.acceptance.test_join import REMOTE_IP, SERVER_IP, remote_netns, run, spawn, wait_for


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def test_an_operator_elsewhere_needs_only_the_address_the_ca_and_an_admin_key(
    tmp_path: Path, procs: Procs
) -> None:
    port, host_port = free_port(), free_port()
    api = f"{SERVER_IP}:{port}"
    server_home, operator = tmp_path / "server-home", tmp_path / "operator-home"
    server_home.mkdir()
    operator.mkdir()
    db = str(tmp_path / "ledger.sqlite3")
    with remote_netns() as ns:
        run(server_home, "ca", "init")
        ledger = Ledger.open(db)
        ledger.register_host(
            HostCapabilities(
                host_id="cloud-1", host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
                isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
            ),
            time.time() - 3600,  # (and never since: it is listed unresponsive)
        )  # fmt: skip
        server = spawn(procs, server_home, "server", "serve", "--listen", api, "--host-listen",
                       f"{SERVER_IP}:{host_port}", "--db", db)  # fmt: skip
        wait_for(server, "listening on")
        # The bootstrap, on the server's machine: the operator's key (and a tenant's).
        made = run(server_home, "key", "create", "--tenant", "ops", "--scope", "admin",
                   "--db", db).stdout.splitlines()  # fmt: skip
        admin_key, admin_id = made[-1], made[0].split()[2]
        tenant_key = run(server_home, "key", "create", "--tenant", "team-a",
                         "--db", db).stdout.splitlines()[-1]  # fmt: skip
        shutil.copy(server_home / "ca" / "ca.crt", operator / "fleet-ca.crt")

        def operate(*args: str, key: str = admin_key) -> subprocess.CompletedProcess[str]:
            """`fleet ARGS` on the operator's machine: its namespace, its home, three variables."""
            env = {"FLEET_SERVER": api, "FLEET_CA": str(operator / "fleet-ca.crt"),
                   "FLEET_KEY": key}  # fmt: skip
            return run(operator, *args, netns=ns, check=False, extra_env=env)

        commands = [
            ("ListHosts", ["host", "list"]),
            ("DrainHost", ["host", "drain", "cloud-1", "--deadline", "10m"]),
            ("CreateJoinToken", ["host", "token", "create", "--class", "cpu", "--uses", "2"]),
            ("CreateKey", ["key", "create", "--tenant", "team-b"]),
            ("SetPool", ["pool", "set", "batch", "--class", "cpu", "--max-running", "8"]),
        ]
        for _, argv in commands:  # a tenant's key first: refused, nothing changes
            refused = operate(*argv, key=tenant_key)
            assert refused.returncode == 2 and "PERMISSION_DENIED" in refused.stderr, (
                argv, refused.stderr)  # fmt: skip
        assert ledger.host_states() == {"cloud-1": "ready"}
        assert ledger.identities.join_tokens() == [] and ledger.pools() == []
        assert ledger.identities.keys("team-b") == []

        done = {rpc: operate(*argv) for rpc, argv in commands}
        for rpc, out in done.items():
            assert out.returncode == 0, (rpc, out.stderr)
        # (unresponsive: registered by hand, it never beats; listed as the ledger holds it)
        listed = done["ListHosts"].stdout.splitlines()[1].split()
        assert listed[:3] == ["cloud-1", "cpu", "unresponsive"]
        assert "host cloud-1 draining" in done["DrainHost"].stdout
        assert ledger.host_states()["cloud-1"].startswith("drain")
        [token] = ledger.identities.join_tokens()
        assert token.uses_left == 2 and done["CreateJoinToken"].stdout.splitlines()[-1]
        assert [k.tenant for k in ledger.identities.keys("team-b")] == ["team-b"]
        assert [(v.pool.name, v.pool.max_running) for v in ledger.pools()] == [("batch", 8)]
        ledger.engine.dispose()

        # The server saw each call come through the veth, and logged it with the key's id.
        log = server.log.read_text()
        assert f"ipv4:{REMOTE_IP}:" in log
        records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
        calls = {(r.get("rpc"), r.get("key_id")) for r in records if r["event"] == "admin_call"}
        for rpc, _ in commands:
            assert (rpc, admin_id) in calls, (rpc, calls)
    # The operator's machine holds nothing of the server's: no ledger, no CA.
    assert sorted(p.name for p in operator.iterdir()) == ["fleet-ca.crt"]
