"""Egress enforcement on the namespace runtime, against real test hosts in network namespaces.

Every packet stays inside namespaces these tests create (see tests/networld.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.core.errors import NotFound
from fleet.core.smolfile import parse_smolfile
from fleet.runtime.base import MachineSpec
from fleet.runtime.namespace import NamespaceRuntime
from fleet.runtime.namespace_machine import NamespaceMachine
from fleet.runtime.netns import NetConfig
from tests.networld import GATEWAY, NetWorld, networld

pytestmark = pytest.mark.sandbox

PROBE = r"""
import json, socket, sys
out = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    r = {}
    try:
        addr = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
        r["resolved"] = addr
    except socket.gaierror as exc:
        r["dns_error"] = str(exc)
        out[target] = r
        continue
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((addr, int(port)))
        r["reply"] = s.recv(100).decode().strip()
    except OSError as exc:
        r["connect_error"] = str(exc)
    out[target] = r
print(json.dumps(out))
"""
ALLOWLIST = 'image = "minimal"\n[network]\nallow_hosts = ["svc.fleet.test"]\n'


@pytest.fixture(scope="module")
def world() -> Iterator[NetWorld]:
    with networld() as w:
        yield w


def _netns() -> set[str]:
    return set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()


def probe(
    world: NetWorld,
    rootfs: Path,
    tmp_path: Path,
    smolfile: str,
    targets: list[str],
    gateway: tuple[str, int] | None = None,
) -> tuple[dict[str, dict[str, str]], list[Any]]:
    """Runs the probe in a fresh machine; returns its findings and the machine's egress events."""
    runtime = NamespaceRuntime(
        tmp_path / "machines", NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
    )
    spec = MachineSpec(
        name=f"eg-{uuid.uuid4().hex[:8]}", smolfile=parse_smolfile(smolfile).spec,
        image_digest="sha256:x", rootfs=rootfs, labels={"host": "egress-test"}, gateway=gateway,
    )  # fmt: skip

    async def go() -> tuple[dict[str, dict[str, str]], list[Any]]:
        machine: NamespaceMachine = await runtime.create(spec)
        try:
            result = await machine.exec(["python3", "-c", PROBE, *targets], timeout_s=60)
            assert result.exit_code == 0, result.stderr.decode()
            return json.loads(result.stdout), await machine.egress_events()
        finally:
            await machine.delete()

    return asyncio.run(go())


def test_allowlisted_name_and_its_subdomain_resolve_and_answer(
    world: NetWorld, rootfs: Path, tmp_path: Path
) -> None:
    found, events = probe(
        world, rootfs, tmp_path, ALLOWLIST, ["svc.fleet.test:8080", "api.svc.fleet.test:8080"]
    )
    assert found["svc.fleet.test:8080"]["reply"] == "hello from 203.0.113.10"
    assert found["api.svc.fleet.test:8080"]["reply"] == "hello from 198.51.100.20"
    assert events == []


def test_everything_else_is_refused_and_recorded(
    world: NetWorld, rootfs: Path, tmp_path: Path
) -> None:
    """Unlisted name, unlisted IP, metadata, the host itself, and a rebinding name."""
    targets = [
        "other.test:8080",  # a name not in allow_hosts
        "198.51.100.99:8080",  # an IP literal not in allow_cidrs
        "169.254.169.254:80",  # cloud metadata
        f"{GATEWAY[0]}:{GATEWAY[1]}",  # the host's own address (here: the gateway's)
        "rebind.svc.fleet.test:8080",  # allowed name answered with a private address
        "meta.svc.fleet.test:80",  # allowed name answered with the metadata address
    ]
    found, events = probe(world, rootfs, tmp_path, ALLOWLIST, targets)
    assert "not known" in found["other.test:8080"]["dns_error"]  # NXDOMAIN
    for target in targets[1:4]:
        assert "refused" in found[target]["connect_error"], (target, found[target])
    assert "dns_error" in found["rebind.svc.fleet.test:8080"]
    assert "dns_error" in found["meta.svc.fleet.test:80"]
    seen = {(e.kind, e.destination): e.reason for e in events}
    assert seen[("dns", "other.test")] == "not in allow_hosts"
    assert "not in allow_cidrs" in seen[("connect", "tcp://198.51.100.99:8080")]
    assert "metadata" in seen[("connect", "tcp://169.254.169.254:80")]
    assert "host's own address" in seen[("connect", f"tcp://{GATEWAY[0]}:{GATEWAY[1]}")]
    assert "DNS rebinding" in seen[("dns", "rebind.svc.fleet.test -> 10.9.9.9")]
    assert "metadata" in seen[("dns", "meta.svc.fleet.test -> 169.254.169.254")]
    assert all(e.machine.startswith("eg-") and e.at > 0 for e in events)


def test_allow_cidrs_lifts_a_private_range_but_never_the_floor(
    world: NetWorld, rootfs: Path, tmp_path: Path
) -> None:
    smolfile = (
        'image = "minimal"\n[network]\nallow_hosts = ["svc.fleet.test"]\n'
        'allow_cidrs = ["10.9.9.0/24", "169.254.0.0/16"]\n'
    )
    found, events = probe(
        world, rootfs, tmp_path, smolfile,
        ["10.9.9.9:8080", "rebind.svc.fleet.test:8080", "169.254.169.254:80"],
    )  # fmt: skip
    assert found["10.9.9.9:8080"]["reply"] == "hello from 10.9.9.9"
    assert found["rebind.svc.fleet.test:8080"]["reply"] == "hello from 10.9.9.9"
    assert "refused" in found["169.254.169.254:80"]["connect_error"]
    assert [e.destination for e in events] == ["tcp://169.254.169.254:80"]


def test_open_egress_reaches_any_public_address_above_the_floor(
    world: NetWorld, rootfs: Path, tmp_path: Path
) -> None:
    found, events = probe(
        world, rootfs, tmp_path, 'image = "minimal"\nnet = true\n',
        ["other.test:8080", "198.51.100.99:8080", "169.254.169.254:80", "10.9.9.9:8080"],
    )  # fmt: skip
    assert found["other.test:8080"]["reply"] == "hello from 198.51.100.99"
    assert found["198.51.100.99:8080"]["reply"] == "hello from 198.51.100.99"
    assert "refused" in found["169.254.169.254:80"]["connect_error"]
    assert "refused" in found["10.9.9.9:8080"]["connect_error"]
    assert {e.destination for e in events} == {"tcp://169.254.169.254:80", "tcp://10.9.9.9:8080"}


def test_gateway_is_reachable_only_for_rollouts_that_use_it(
    world: NetWorld, rootfs: Path, tmp_path: Path
) -> None:
    target = f"{GATEWAY[0]}:{GATEWAY[1]}"
    found, _ = probe(world, rootfs, tmp_path, ALLOWLIST, [target], gateway=GATEWAY)
    assert found[target]["reply"] == "hello from the gateway"
    found, _ = probe(world, rootfs, tmp_path, ALLOWLIST, [target])
    assert "refused" in found[target]["connect_error"]


async def test_machine_without_egress_gets_no_namespace_and_deletion_removes_it(
    world: NetWorld, rootfs: Path, tmp_path: Path
) -> None:
    before = _netns()
    runtime = NamespaceRuntime(
        tmp_path / "machines", NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
    )

    def spec(text: str) -> MachineSpec:
        return MachineSpec(
            name=f"eg-{uuid.uuid4().hex[:8]}", smolfile=parse_smolfile(text).spec,
            image_digest="sha256:x", rootfs=rootfs, labels={"host": "egress-reap"},
        )  # fmt: skip

    offline = await runtime.create(spec('image = "minimal"\n'))
    assert offline.net is None and _netns() == before
    await offline.delete()
    online = await runtime.create(spec(ALLOWLIST))
    assert online.net is not None and _netns() == before | {online.net.netns}
    await online.delete()
    assert _netns() == before
    # An agent killed with machines up: the next one's reaper removes their namespaces.
    left = await runtime.create(spec(ALLOWLIST))
    assert left.net is not None and left.net.netns in _netns()
    again = NamespaceRuntime(
        tmp_path / "machines", NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
    )
    assert await again.reap("egress-reap") == 1
    assert _netns() == before
    assert not list((tmp_path / "machines" / "net-leases").iterdir())
    assert left.dns is not None
    await left.dns.stop()  # the killed agent's socket, closed here as its exit would


def leased_spec(rootfs: Path, host: str) -> MachineSpec:
    """An allowlisted machine labelled as an agent labels a rollout's machine with its lease."""
    return MachineSpec(
        name=f"eg-{uuid.uuid4().hex[:8]}", smolfile=parse_smolfile(ALLOWLIST).spec,
        image_digest="sha256:x", rootfs=rootfs,
        labels={"host": host, "work": "w-1", "fence": "1"},
    )  # fmt: skip


async def test_a_restarted_agent_adopts_a_machine_with_its_network(
    world: NetWorld, rootfs: Path, tmp_path: Path
) -> None:
    """After an agent crash the machine's namespace, link and firewall are still there; the
    agent that adopts it starts a new DNS forwarder, and what was refused before the crash is
    still reported, once."""
    before = _netns()
    net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
    spec = leased_spec(rootfs, "egress-adopt")
    targets = ["other.test:8080", "198.51.100.99:8080", "svc.fleet.test:8080"]

    first = await NamespaceRuntime(tmp_path / "machines", net).create(spec)
    result = await first.exec(["python3", "-c", PROBE, *targets], timeout_s=60)
    found_before = json.loads(result.stdout)
    assert first.dns is not None and first.net is not None
    await first.dns.stop()  # the agent dies: its forwarder with it, the machine stays
    netns = first.net.netns

    again = NamespaceRuntime(tmp_path / "machines", net)
    [leftover] = await again.leftovers("egress-adopt")
    assert leftover.adoptable, leftover.why_not
    adopted = await again.adopt(leftover, spec)
    assert adopted.net is not None and adopted.net.netns == netns
    result = await adopted.exec(["python3", "-c", PROBE, *targets], timeout_s=60)
    found_after = json.loads(result.stdout)
    events = await adopted.egress_events()
    later = await adopted.egress_events()
    await adopted.delete()

    for found in (found_before, found_after):
        assert found["svc.fleet.test:8080"]["reply"] == "hello from 203.0.113.10"
        assert "not known" in found["other.test:8080"]["dns_error"]
        assert "refused" in found["198.51.100.99:8080"]["connect_error"]
    seen = [(e.kind, e.destination) for e in events]
    assert seen.count(("dns", "other.test")) == 2  # once before the crash, once after
    assert seen.count(("connect", "tcp://198.51.100.99:8080")) == 1  # one firewall entry
    assert later == []
    assert _netns() == before
    assert not list((tmp_path / "machines" / "net-leases").iterdir())


async def test_a_machine_that_cannot_be_adopted_after_all_is_removed_whole(
    world: NetWorld, rootfs: Path, tmp_path: Path
) -> None:
    """Its link's lease is lost: adopting it fails with the reason, and its namespace, cgroup
    and directory are gone, not left for nobody."""
    before = _netns()
    net = NetConfig(uplink_netns=world.uplink, dns_upstream=world.dns)
    spec = leased_spec(rootfs, "egress-lost")

    first = await NamespaceRuntime(tmp_path / "machines", net).create(spec)
    assert first.dns is not None
    await first.dns.stop()
    for lease in (tmp_path / "machines" / "net-leases").iterdir():
        lease.unlink()
    again = NamespaceRuntime(tmp_path / "machines", net)
    [leftover] = await again.leftovers("egress-lost")
    with pytest.raises(NotFound, match="no link address is leased"):
        await again.adopt(leftover, spec)
    assert await again.leftovers("egress-lost") == []
    assert not first.cgroup.exists()

    assert _netns() == before
