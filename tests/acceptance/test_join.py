"""A second host joins for real: its own network namespace and an empty `$FLEET_HOME`, reaching
the server only through a veth address, enrolled with a join token, fetching the image from the
server by digest; tenants with their own keys.

Everything runs as a user would run it: `fleet ca init`, `fleet serve`, `fleet host token
create`, `fleet agent --join` (under `ip netns exec`), `fleet key create`, `fleet submit`,
`fleet get`, `fleet host revoke`, each a process of its own. Traffic stays on the veth pair and
loopback, in a namespace this test makes and deletes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from fleet.api.pb import host_pb2, host_pb2_grpc
from fleet.config import Paths
from tests.acceptance.procs import FLEET, Proc, Procs, free_port
from tests.conftest import REPO

SERVER_IP = "198.18.77.1"  # the benchmark-testing range: never a real host's
REMOTE_IP = "198.18.77.2"


@contextmanager
def remote_netns() -> Iterator[str]:
    """A network namespace for the second host, joined to this one by one veth pair."""
    tag = uuid.uuid4().hex[:6]
    ns, here, there = f"fjoin-{tag}", f"fj{tag}a", f"fj{tag}b"

    def sh(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, timeout=30)

    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there, "netns", ns)
        sh("ip", "addr", "add", f"{SERVER_IP}/30", "dev", here)
        sh("ip", "link", "set", here, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "addr", "add", f"{REMOTE_IP}/30", "dev", there)
        sh("ip", "-n", ns, "link", "set", there, "up")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "delete", here], capture_output=True, timeout=30)


def home_with_images(root: Path, name: str) -> Path:
    """A `$FLEET_HOME` of its own, its image store a copy of this machine's (hard links)."""
    home = root / name
    home.mkdir()
    source = Paths.from_env().images
    try:
        subprocess.run(["cp", "-al", str(source), str(home / "images")], check=True,
                       capture_output=True, timeout=120)  # fmt: skip
    except subprocess.CalledProcessError:
        shutil.copytree(source, home / "images", symlinks=True)
    return home


def run(home: Path, *args: str, netns: str = "", check: bool = True, timeout: float = 60,
        extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    argv = [*FLEET, *args]
    if netns:
        # nsenter changes the network namespace only (`ip netns exec` also remounts /sys,
        # hiding the cgroup hierarchy the namespace runtime needs).
        argv = ["nsenter", f"--net=/run/netns/{netns}", *argv]
    env = {**os.environ, "FLEET_HOME": str(home), "FLEET_SERVER": "", "FLEET_KEY": "",
           **(extra_env or {})}  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env)  # fmt: skip
    if check and done.returncode != 0:
        raise AssertionError(f"fleet {' '.join(args)} exited {done.returncode}: {done.stderr}")
    return done


def spawn(procs: Procs, home: Path, name: str, *args: str, netns: str = "",
          extra_env: dict[str, str] | None = None) -> Proc:  # fmt: skip
    log = procs.root / f"{name}.log"
    argv = [*FLEET, "--log-level", "info", *args]
    if netns:
        # nsenter changes the network namespace only (`ip netns exec` also remounts /sys,
        # hiding the cgroup hierarchy the namespace runtime needs).
        argv = ["nsenter", f"--net=/run/netns/{netns}", *argv]
    env = {**os.environ, "FLEET_HOME": str(home), "FLEET_SERVER": "", **(extra_env or {})}
    with log.open("w") as out:  # the child holds its own copy of the descriptor
        popen = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 text=True, env=env)  # fmt: skip
    proc = Proc(name, popen, log)
    procs.started.append(proc)
    return proc


def wait_for(proc: Proc, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in proc.log.read_text():
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{proc.name}: no {text!r}: {proc.log.read_text()[-3000:]}")
        time.sleep(0.1)


def rollout(home: Path, server: str, key: str, ca: Path, rid: str) -> dict:  # type: ignore[type-arg]
    out = run(home, "get", "--server", server, "--key", key, "--ca", str(ca), rid, "--json")
    got: dict = json.loads(out.stdout)  # type: ignore[type-arg]
    return got


def wait_state(home: Path, server: str, key: str, ca: Path, rid: str, states: set[str],
               timeout_s: float = 90) -> dict:  # type: ignore[type-arg]  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        got = rollout(home, server, key, ca, rid)
        if got["state"].removeprefix("ROLLOUT_STATE_") in states:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{rid} still {got['state']} after {timeout_s}s")
        time.sleep(0.3)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.mark.sandbox
def test_a_cloud_host_joins_and_tenants_are_kept_apart(tmp_path: Path, procs: Procs) -> None:
    port, host_port = free_port(), free_port()
    api = f"{SERVER_IP}:{port}"
    server_home = home_with_images(tmp_path, "server-home")
    # The hosts start with empty homes: they fetch the image from the server by digest.
    remote_home, local_home = tmp_path / "remote-home", tmp_path / "local-home"
    remote_home.mkdir()
    local_home.mkdir()
    ca_crt = server_home / "ca" / "ca.crt"
    db = str(tmp_path / "ledger.sqlite3")
    with remote_netns() as ns:
        serve = ["serve", "--listen", api, "--host-listen", f"{SERVER_IP}:{host_port}",
                 "--db", db, "--lease-ttl-s", "3", "--heartbeat-s", "0.5"]  # fmt: skip
        # Beyond loopback without a CA: refused, saying what to do.
        refused = run(server_home, *serve, check=False, timeout=30)
        assert refused.returncode != 0 and "fleet ca init" in refused.stderr
        fingerprint = run(server_home, "ca", "init").stdout.split("fingerprint: ")[1].strip()
        server = spawn(procs, server_home, "server", *serve)
        wait_for(server, "listening on")
        assert "(TLS, API keys)" in server.log.read_text()

        token_out = run(server_home, "host", "token", "create", "--class", "cpu", "--db", db,
                        "--label", "site=cloud").stdout.splitlines()  # fmt: skip
        token = token_out[-1]
        assert any(fingerprint in line for line in token_out)
        join = ["agent", "--class", "cpu", "--runtime", "namespace", "--server", api,
                "--host-id", "cloud-1", "--slots", "2"]  # fmt: skip
        remote = spawn(procs, remote_home, "remote-agent", *join, "--join", token,
                       "--ca-fingerprint", fingerprint, netns=ns)  # fmt: skip
        wait_for(remote, "agent_registered")
        identity = remote_home / "host"
        assert (identity / "host.key").stat().st_mode & 0o777 == 0o600
        # The remote host reached the server through the veth only: its namespace has no
        # route anywhere else, and the server saw it come from its veth address.
        assert f"ipv4:{REMOTE_IP}:" in server.log.read_text()

        # The token was single-use; an expired one is refused too.
        again = run(tmp_path, *join[:-4], "--host-id", "cloud-2", "--join", token,
                    "--ca-fingerprint", fingerprint, "--identity-dir", str(tmp_path / "id2"),
                    netns=ns, check=False, timeout=30)  # fmt: skip
        assert again.returncode != 0 and "used up" in again.stderr
        short = run(server_home, "host", "token", "create", "--class", "cpu", "--ttl", "1s",
                    "--db", db).stdout.splitlines()[-1]  # fmt: skip
        time.sleep(1.5)
        late = run(tmp_path, *join[:-4], "--host-id", "cloud-3", "--join", short,
                   "--ca-fingerprint", fingerprint, "--identity-dir", str(tmp_path / "id3"),
                   netns=ns, check=False, timeout=30)  # fmt: skip
        assert late.returncode != 0 and "expired" in late.stderr
        # A wrong pin: nothing is sent.
        wrong = run(tmp_path, *join[:-4], "--host-id", "cloud-4", "--join", short,
                    "--ca-fingerprint", "sha256:" + "ab" * 32, "--identity-dir",
                    str(tmp_path / "id4"), netns=ns, check=False, timeout=30)  # fmt: skip
        assert wrong.returncode != 0 and "presents no CA with fingerprint" in wrong.stderr

        # A client with no certificate is refused on HostService, on either endpoint.
        async def no_cert() -> tuple[grpc.StatusCode, grpc.StatusCode]:
            creds = grpc.ssl_channel_credentials(root_certificates=ca_crt.read_bytes())
            claim = host_pb2.ClaimWorkRequest(host_id="cloud-1", max_items=1)
            codes = []
            for address in (api, f"{SERVER_IP}:{host_port}"):
                async with grpc.aio.secure_channel(address, creds) as channel:
                    try:
                        await host_pb2_grpc.HostServiceStub(channel).ClaimWork(claim, timeout=5)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
            return codes[0], codes[1]

        import asyncio

        on_api, on_hosts = asyncio.run(no_cert())
        assert on_api == grpc.StatusCode.UNAUTHENTICATED
        assert on_hosts == grpc.StatusCode.UNAVAILABLE  # the handshake wants a certificate

        def key(tenant: str, scope: str = "rollouts:read,rollouts:write") -> str:
            out = run(server_home, "key", "create", "--tenant", tenant, "--scope", scope,
                      "--db", db)  # fmt: skip
            return out.stdout.splitlines()[-1]

        key_a, key_b, reader = key("team-a"), key("team-b"), key("team-a", "rollouts:read")
        client = tmp_path / "client-home"
        client.mkdir()
        common = ["--server", api, "--ca", str(ca_crt)]
        # A directory in, a file out: through the CLI, to the cloud host and back.
        task = tmp_path / "task"
        (task / "src").mkdir(parents=True)
        (task / "src" / "main.py").write_text("print('hello from the cloud host')\n")
        (task / "README").write_text("a task\n")
        sub = run(client, "submit", *common, "--key", key_a, "-s",
                  str(REPO / "smolfiles" / "minimal.smolfile"), "--input", f"{task}:/task",
                  "--output", "/results/out.txt", "--step",
                  "sh -c 'mkdir -p /results && python3 /task/src/main.py | tee /results/out.txt "
                  "&& ls /task >> /results/out.txt'", "-q")  # fmt: skip
        rid = sub.stdout.strip()
        done = wait_state(client, api, key_a, ca_crt, rid, {"SUCCEEDED", "FAILED"})
        assert done["state"] == "ROLLOUT_STATE_SUCCEEDED", done
        assert done["host_id"] == "cloud-1"
        import base64

        assert base64.b64decode(done["results"][0]["stdout"]) == b"hello from the cloud host\n"
        got = run(client, "get", *common, "--key", key_a, rid, "--download",
                  str(tmp_path / "downloaded"))  # fmt: skip
        assert "output    /results/out.txt: file" in got.stdout
        assert (tmp_path / "downloaded" / "out.txt").read_bytes() == (
            b"hello from the cloud host\nREADME\nsrc\n"
        )
        theirs = run(client, "get", *common, "--key", key_b, rid, "--download",
                     str(tmp_path / "stolen"), check=False)  # fmt: skip
        assert theirs.returncode != 0 and not (tmp_path / "stolen").exists()
        # Three more on the cloud host (five with the one above and the one revoked below).
        more = [
            run(client, "submit", *common, "--key", key_a, "-s",
                str(REPO / "smolfiles" / "minimal.smolfile"), "--step", "true", "-q").stdout.strip()
            for _ in range(3)
        ]  # fmt: skip
        for other_id in more:
            again_done = wait_state(client, api, key_a, ca_crt, other_id, {"SUCCEEDED", "FAILED"})
            assert again_done["host_id"] == "cloud-1"
        # Tenant B sees nothing of it; a read-only key cannot submit.
        for cmd in (["get", rid], ["watch", rid], ["cancel", rid], ["egress-events", rid]):
            other = run(client, cmd[0], *common, "--key", key_b, *cmd[1:], check=False)
            assert other.returncode != 0 and "NOT_FOUND" in other.stderr, (cmd, other.stderr)
        listed = run(client, "list", *common, "--key", key_b)
        assert rid not in listed.stdout
        ro = run(client, "submit", *common, "--key", reader, "-s",
                 str(REPO / "smolfiles" / "minimal.smolfile"), "--step", "true",
                 check=False)  # fmt: skip
        assert ro.returncode != 0 and "PERMISSION_DENIED" in ro.stderr
        assert "rollouts:write" in ro.stderr
        nokey = run(client, "list", *common, check=False)
        assert nokey.returncode != 0 and "UNAUTHENTICATED" in nokey.stderr

        # Revoked while it holds a lease: its next call is refused, it stops, and the work
        # finishes on another host with exactly one result.
        long = run(client, "submit", *common, "--key", key_a, "-s",
                   str(REPO / "smolfiles" / "minimal.smolfile"), "--step",
                   # (long on the first attempt: still running when the revoke lands, however
                   # slow the CLI calls before it are)
                   "sh -c '[ \"$FLEET_ATTEMPT\" = 1 ] && sleep 60; echo finished'",
                   "-q")  # fmt: skip
        lid = long.stdout.strip()
        running = wait_state(client, api, key_a, ca_crt, lid, {"RUNNING"})
        assert running["attempt_history"][-1]["host_id"] == "cloud-1"
        revoked = run(server_home, "host", "revoke", "cloud-1", "--db", db)
        assert "1 leases" in revoked.stdout
        assert remote.popen.wait(timeout=30) != 0
        assert "revoked" in remote.log.read_text()
        assert remote.log.read_text().count("image_fetched") == 1  # once for five rollouts
        local_token = run(server_home, "host", "token", "create", "--class", "cpu",
                          "--db", db).stdout.splitlines()[-1]  # fmt: skip
        local = spawn(procs, local_home, "local-agent", "agent", "--class", "cpu", "--runtime",
                      "namespace", "--server", api, "--host-id", "local-1", "--join",
                      local_token, "--ca", str(ca_crt))  # fmt: skip
        wait_for(local, "agent_registered")
        final = wait_state(client, api, key_a, ca_crt, lid, {"SUCCEEDED", "FAILED"})
        assert final["state"] == "ROLLOUT_STATE_SUCCEEDED", final
        assert final["host_id"] == "local-1" and len(final["results"]) == 1
        assert base64.b64decode(final["results"][0]["stdout"]) == b"finished\n"
        assert [a["host_id"] for a in final["attempt_history"]] == ["cloud-1", "local-1"]
        # A restarted host with a valid certificate needs no token.
        local.stop()
        again_local = spawn(procs, local_home, "local-agent-2", "agent", "--class", "cpu",
                            "--runtime", "namespace", "--server", api)  # fmt: skip
        wait_for(again_local, "agent_registered")
        assert "local-1" in again_local.log.read_text()
        hosts = run(server_home, "host", "list", "--db", db).stdout
        print(f"\nacceptance: {rid} on cloud-1, {lid} moved cloud-1 -> local-1 after revoke")
        print(hosts)


@pytest.mark.sandbox
def test_a_cloud_host_pulls_the_image_from_a_registry(tmp_path: Path, procs: Procs) -> None:
    """The image pushed to a registry (TLS from the fleet CA, htpasswd), the server pointing
    hosts at it: a host with an empty `$FLEET_HOME`, in its own network namespace, pulls it
    once for five rollouts."""
    from fleet.identity.ca import CertificateAuthority
    from tests.registry import PASSWORD, USER, registry

    port, host_port = free_port(), free_port()
    api = f"{SERVER_IP}:{port}"
    server_home = home_with_images(tmp_path, "server-home")
    remote_home = tmp_path / "remote-home"
    remote_home.mkdir()
    db = str(tmp_path / "ledger.sqlite3")
    auth = f"{USER}:{PASSWORD}"
    with remote_netns() as ns:
        fingerprint = run(server_home, "ca", "init").stdout.split("fingerprint: ")[1].strip()
        ca = CertificateAuthority.load(server_home / "ca")
        with registry(tmp_path / "registry", ca, host=SERVER_IP) as reg:
            env_auth = {"FLEET_REGISTRY_AUTH": auth}
            ca_crt = server_home / "ca" / "ca.crt"
            pushed = run(server_home, "image", "push", "minimal", "--registry", reg.repo(),
                         "--ca", str(ca_crt), extra_env=env_auth)  # fmt: skip
            assert "pushed minimal" in pushed.stdout
            server = spawn(procs, server_home, "server", "serve", "--listen", api,
                           "--host-listen", f"{SERVER_IP}:{host_port}", "--db", db,
                           "--registry", reg.repo())  # fmt: skip
            wait_for(server, "listening on")
            token = run(server_home, "host", "token", "create", "--class", "cpu", "--db",
                        db).stdout.splitlines()[-1]  # fmt: skip
            remote = spawn(procs, remote_home, "remote-agent", "agent", "--class", "cpu",
                           "--runtime", "namespace", "--server", api, "--host-id", "cloud-1",
                           "--join", token, "--ca-fingerprint", fingerprint, netns=ns,
                           extra_env=env_auth)  # fmt: skip
            wait_for(remote, "agent_registered")
            key = run(server_home, "key", "create", "--tenant", "team-a", "--db",
                      db).stdout.splitlines()[-1]  # fmt: skip
            client = tmp_path / "client-home"
            client.mkdir()
            ids = [
                run(client, "submit", "--server", api, "--ca", str(ca_crt), "--key", key, "-s",
                    str(REPO / "smolfiles" / "minimal.smolfile"), "--step", f"echo {i}",
                    "-q").stdout.strip()
                for i in range(5)
            ]  # fmt: skip
            for rid in ids:
                done = wait_state(client, api, key, ca_crt, rid, {"SUCCEEDED", "FAILED"})
                assert done["state"] == "ROLLOUT_STATE_SUCCEEDED", done
            log = remote.log.read_text()
            assert log.count("image_fetched") == 1 and f'"source": "{reg.repo()}"' in log
