"""Per-machine network namespaces with an nftables egress firewall (namespace runtime).

A machine that asks for egress gets its own network namespace: loopback, and one veth link to
the uplink (the host, or a namespace the operator names). Its firewall (table `inet fleet`,
inside that namespace, out of the machine's reach) drops everything except:

- loopback, where fleet's DNS forwarder answers at 127.0.0.53;
- `allow_cidrs` ranges;
- addresses the forwarder admitted because it answered them for an allowed name (for the
  answer's TTL);
- with open egress (`net = true`, no allowlist), any address above the floor;
- the inference gateway's address and port, only for machines whose rollout uses it.

The floor (cloud metadata, link-local, loopback, the host's own addresses, and private ranges
not listed in `allow_cidrs`) is checked first, so no allowlist lifts it. Refused connections
are recorded by the firewall itself (dynamic sets) and read back as egress events.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import structlog

from fleet.core.egress import EgressEvent, EgressMode, EgressRules
from fleet.core.errors import NotFound, Unavailable

log = structlog.get_logger(__name__)

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
DNS_ADDRESS = "127.0.0.53"
REFUSED_TIMEOUT = "1h"
_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(path: str | None, fn: Callable[[], T]) -> T:
    """Runs `fn` in a thread that joined the network namespace at `path` (None: ours).

    Sockets keep the namespace they were created in, so this is how the agent opens a
    listening socket inside a machine's namespace and an upstream one in the uplink's.
    """
    if path is None:
        return fn()
    box: dict[str, object] = {}

    def run() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(path, os.O_RDONLY)
        try:
            if _libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                box["error"] = OSError(err, f"setns({path}): {os.strerror(err)}")
                return
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc
            finally:
                _libc.setns(own, CLONE_NEWNET)
        finally:
            os.close(own)
            os.close(target)

    thread = threading.Thread(target=run, name="netns")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


async def _run(*argv: str, stdin: bytes | None = None) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin)
    if proc.returncode != 0:
        raise Unavailable(f"{' '.join(argv[:6])}: {err.decode(errors='replace').strip()}")
    return out.decode()


def _run_in(netns_path: str, *argv: str, stdin: bytes | None = None) -> str:
    """`argv` run from a thread that joined the namespace at `netns_path` (blocking).

    A child inherits its creating thread's network namespace, so this is `ip netns exec`
    without its mount namespace and sysfs remount: what an nft call needs, at half the cost.
    """

    def run() -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(argv, input=stdin, capture_output=True, check=False)

    proc = in_netns(netns_path, run)
    if proc.returncode != 0:
        raise Unavailable(f"{' '.join(argv[:6])}: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode()


def _ip(netns: str | None, *args: str) -> tuple[str, ...]:
    return ("ip", *(("-n", netns) if netns else ()), *args)


def default_upstream() -> tuple[str, int]:
    """The host's first resolver from /etc/resolv.conf (what the forwarder asks)."""
    try:
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                return parts[1], 53
    except OSError:
        pass
    return "127.0.0.1", 53


@dataclass(frozen=True)
class NetConfig:
    """Where machine links end and which resolver the DNS forwarder asks."""

    uplink_netns: str | None = None
    dns_upstream: tuple[str, int] = field(default_factory=default_upstream)
    address_pool: str = "100.96.0.0/12"

    @property
    def uplink_path(self) -> str | None:
        return f"/run/netns/{self.uplink_netns}" if self.uplink_netns else None


def ruleset(rules: EgressRules, gateway: tuple[str, int] | None) -> str:
    """The machine namespace's nftables table for `rules` (IPv4; IPv6 is dropped)."""

    def elements(items: list[str]) -> str:
        return f"elements = {{ {', '.join(items)} }}" if items else ""

    hard = rules.hard_floor()
    private = rules.private_floor()
    cidrs = rules.allow_cidrs

    def v(items: list[str] | tuple[str, ...], version: int) -> list[str]:
        return [i for i in items if ipaddress.ip_network(i, strict=False).version == version]

    accept_gateway = (
        f"ip daddr {gateway[0]} tcp dport {gateway[1]} accept" if gateway is not None else ""
    )
    dynamic = f"flags dynamic,timeout; timeout {REFUSED_TIMEOUT};"
    open_egress = "meta nfproto ipv4 accept" if rules.mode == EgressMode.OPEN else ""
    return f"""
table inet fleet {{
  set hard4 {{ type ipv4_addr; flags interval; {elements(v(hard, 4))} }}
  set hard6 {{ type ipv6_addr; flags interval; {elements(v(hard, 6))} }}
  set private4 {{ type ipv4_addr; flags interval; {elements(v(private, 4))} }}
  set private6 {{ type ipv6_addr; flags interval; {elements(v(private, 6))} }}
  set cidr4 {{ type ipv4_addr; flags interval; {elements(v(cidrs, 4))} }}
  set cidr6 {{ type ipv6_addr; flags interval; {elements(v(cidrs, 6))} }}
  set dns4 {{ type ipv4_addr; flags timeout; }}
  set refused_tcp {{ type ipv4_addr . inet_service; {dynamic} }}
  set refused_udp {{ type ipv4_addr . inet_service; {dynamic} }}
  set refused_ip {{ type ipv4_addr; {dynamic} }}
  chain output {{
    type filter hook output priority filter; policy drop;
    oif "lo" accept
    ct state established,related accept
    meta nfproto ipv6 goto refuse
    {accept_gateway}
    ip daddr @hard4 goto refuse
    ip daddr @cidr4 accept
    ip daddr @private4 goto refuse
    ip daddr @dns4 accept
    {open_egress}
    goto refuse
  }}
  chain refuse {{
    meta nfproto ipv4 meta l4proto tcp add @refused_tcp {{ ip daddr . tcp dport }}
    meta nfproto ipv4 meta l4proto udp add @refused_udp {{ ip daddr . udp dport }}
    meta nfproto ipv4 meta l4proto != {{ tcp, udp }} add @refused_ip {{ ip daddr }}
    meta l4proto tcp reject with tcp reset
    reject with icmpx admin-prohibited
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    ct state established,related accept
  }}
}}
"""


_DURATION = re.compile(r"(\d+)(ms|d|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _seconds(text: str) -> float:
    return sum(int(n) * _UNITS[u] for n, u in _DURATION.findall(text))


_ELEMENT = re.compile(
    r"(\d+\.\d+\.\d+\.\d+)(?: \. (\d+))?(?: timeout (\S+?))?(?: expires (\S+?))?(?=[,\s}])"
)


REFUSED_SETS = ("refused_tcp", "refused_udp", "refused_ip")


def split_sets(text: str) -> dict[str, str]:
    """The text of each `set NAME { ... }` block in `nft list table` output, by name.

    The text, not `nft -j`: nft's JSON gives an element's `expires` in whole seconds (nft
    1.0.6), so a refusal's time could be placed up to a second early, before the DNS refusal
    that preceded it; the text gives milliseconds.

    A block ends at the first line that is only its closing brace (elements may span lines).
    """
    out: dict[str, str] = {}
    name: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if name is None:
            if (found := re.fullmatch(r"\s*set (\S+) \{", line)) is not None:
                name, lines = found.group(1), []
        elif line.strip() == "}":
            out[name], name = "\n".join(lines), None
        else:
            lines.append(line)
    return out


def parse_refused(text: str, now: float) -> list[tuple[str, float]]:
    """(destination, when first refused) from `nft list set` output of a refused_* set."""
    body = text.split("elements = {", 1)
    if len(body) < 2:
        return []
    # An element shows its own timeout only where it differs from the set's.
    default = re.search(r"(?m)^\s*timeout (\S+)\s*$", body[0])
    out = []
    for ip, port, timeout, expires in _ELEMENT.findall(body[1]):
        added = now
        timeout = timeout or (default.group(1) if default else "")
        if timeout and expires:
            added = now - (_seconds(timeout) - _seconds(expires))
        out.append((f"{ip}:{port}" if port else ip, added))
    return out


class PoolExhausted(Unavailable):
    pass


class MachineNet:
    """One machine's network namespace, link, firewall and refusal log."""

    def __init__(self, config: NetConfig, state_dir: Path, machine: str, netns: str) -> None:
        self.config = config
        self.state_dir = state_dir
        self.machine = machine
        self.netns = netns
        self.index: int | None = None
        self.rules: EgressRules | None = None
        self._seen: set[str] = set()

    @property
    def path(self) -> str:
        return f"/run/netns/{self.netns}"

    def _claim_index(self) -> int:
        """A free /30 in the pool, claimed by creating its file exclusively (crash-safe)."""
        pool = ipaddress.ip_network(self.config.address_pool)
        slots = pool.num_addresses // 4
        leases = self.state_dir / "net-leases"
        leases.mkdir(parents=True, exist_ok=True)
        start = int.from_bytes(os.urandom(4), "big") % slots
        for i in range(slots):
            index = (start + i) % slots
            try:
                fd = os.open(leases / str(index), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                continue
            os.write(fd, self.netns.encode())
            os.close(fd)
            return index
        raise PoolExhausted(f"no free link address in {pool}: {slots} machines have egress")

    @classmethod
    def attach(
        cls, config: NetConfig, state_dir: Path, machine: str, netns: str, rules: EgressRules
    ) -> MachineNet:
        """The network an earlier agent made for this machine, as it left it (after a crash):
        its namespace, link and firewall are still there; only the link's lease is looked up."""
        if not Path(f"/run/netns/{netns}").exists():
            raise NotFound(f"machine {machine}: its network namespace {netns} is gone")
        net = cls(config, state_dir, machine, netns)
        net.rules = rules
        for lease in sorted((state_dir / "net-leases").glob("*")):
            with contextlib.suppress(OSError, ValueError):
                if lease.read_text() == netns:
                    net.index = int(lease.name)
                    return net
        raise NotFound(f"machine {machine}: no link address is leased to {netns}")

    def reserve_link_host(self) -> str:
        """Claims the link's addresses now; returns the host's end (what the machine sees)."""
        if self.index is None:
            self.index = self._claim_index()
        return self.link_addresses()[0]

    def link_addresses(self) -> tuple[str, str]:
        assert self.index is not None
        base = ipaddress.ip_network(self.config.address_pool).network_address + 4 * self.index
        return str(base + 1), str(base + 2)

    async def create(self, rules: EgressRules, gateway: tuple[str, int] | None) -> None:
        if self.config.uplink_netns is None:
            await ensure_host_uplink(self.config.address_pool)
        self.rules = rules
        if self.index is None:
            self.index = await asyncio.to_thread(self._claim_index)
        host_ip, machine_ip = self.link_addresses()
        host_if, machine_if = f"fh{self.netns[-10:]}"[:15], f"fm{self.netns[-10:]}"[:15]
        up = self.config.uplink_netns
        # Three processes in all: the uplink's end, the machine's end, its firewall.
        uplink = (
            f"link add {host_if} type veth peer name {machine_if} netns {self.netns}\n"
            f"addr add {host_ip}/30 dev {host_if}\nlink set {host_if} up\n"
        )
        if up is None:  # `netns add` in the same batch; it must run in the host's namespace
            await _run("ip", "-batch", "-", stdin=f"netns add {self.netns}\n{uplink}".encode())
        else:
            await _run("ip", "netns", "add", self.netns)
            await _run(*_ip(up, "-batch", "-"), stdin=uplink.encode())
        inside = (
            f"link set lo up\nlink set {machine_if} name eth0\n"
            f"addr add {machine_ip}/30 dev eth0\nlink set eth0 up\n"
            f"route add default via {host_ip}\n"
        )
        await _run("ip", "-n", self.netns, "-batch", "-", stdin=inside.encode())
        await self._nft("-f", "-", stdin=ruleset(rules, gateway).encode())
        log.info(
            "machine_network_up", machine=self.machine, netns=self.netns, address=machine_ip,
            mode=str(rules.mode), uplink=up or "host",
        )  # fmt: skip

    async def admit(self, addresses: list[tuple[str, int]]) -> None:
        """Lets the machine reach these addresses for their TTLs (answers of the forwarder)."""
        if not addresses:
            return
        items = ", ".join(f"{ip} timeout {max(5, min(ttl, 3600))}s" for ip, ttl in addresses)
        await self._nft("add", "element", "inet", "fleet", "dns4", f"{{ {items} }}")

    async def _nft(self, *args: str, stdin: bytes | None = None) -> str:
        return await asyncio.to_thread(_run_in, self.path, "nft", *args, stdin=stdin)

    async def refused(self) -> list[EgressEvent]:
        """Connections the firewall refused since the last call."""
        out: list[EgressEvent] = []
        # One call for all three sets (nft cannot list several sets in one run).
        sets = split_sets(await self._nft("list", "table", "inet", "fleet"))
        for name in REFUSED_SETS:
            if name not in sets:
                raise Unavailable(f"machine {self.machine}: firewall set {name} is missing")
            proto = name.removeprefix("refused_")
            for destination, at in parse_refused(sets[name], time.time()):
                key = f"{proto}:{destination}"
                if key in self._seen:
                    continue
                self._seen.add(key)
                ip = destination.split(":")[0]
                why = self.rules.address_refusal(ip) if self.rules is not None else None
                out.append(
                    EgressEvent(
                        at=at, machine=self.machine, kind="connect",
                        destination=f"{proto}://{destination}",
                        reason=f"refused by the egress firewall: {why or 'not allowed'}",
                    )
                )  # fmt: skip
        return sorted(out, key=lambda e: e.at)

    async def destroy(self) -> None:
        await destroy_netns(self.netns)
        if self.index is not None:
            (self.state_dir / "net-leases" / str(self.index)).unlink(missing_ok=True)


_host_uplink_ready: set[str] = set()


async def ensure_host_uplink(pool: str) -> None:
    """Machine links that end on the host itself: IPv4 forwarding and masquerade for the pool.

    Fleet's own table `ip fleet_uplink` is replaced whole, so this is idempotent. The machines'
    own firewalls decide what they may reach; this only carries what they let out.
    """
    if pool in _host_uplink_ready:
        return
    table = f"""
table ip fleet_uplink
delete table ip fleet_uplink
table ip fleet_uplink {{
  chain forward {{
    type filter hook forward priority filter; policy accept;
    ip saddr {pool} accept
    ip daddr {pool} ct state established,related accept
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {pool} oifname != "fh*" masquerade
  }}
}}
"""
    await _run("nft", "-f", "-", stdin=table.encode())
    await _run("sysctl", "-qw", "net.ipv4.ip_forward=1")
    _host_uplink_ready.add(pool)
    log.info("host_uplink_ready", pool=pool, table="ip fleet_uplink", ip_forward=1)
    # Every base chain on the forward hook must accept a packet; fleet's own table cannot
    # overrule another table's drop policy (Docker sets iptables FORWARD to DROP).
    if shutil.which("iptables"):
        proc = await asyncio.create_subprocess_exec(
            "iptables", "-S", "FORWARD", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        out, _ = await proc.communicate()
        if b"-P FORWARD DROP" in out:
            log.warning(
                "host_forward_policy_drop",
                reason="iptables FORWARD policy is DROP: machines' allowed egress through this "
                "host will be dropped unless a rule accepts the pool "
                f"(e.g. iptables -I DOCKER-USER -s {pool} -j ACCEPT, and the replies), or "
                "use fleet agent --egress-uplink",
            )


async def destroy_netns(name: str) -> None:
    """Deletes a machine's namespace; its veth pair goes with it."""
    if os.path.exists(f"/run/netns/{name}"):  # noqa: ASYNC240 - one stat
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "delete", name,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        if proc.returncode != 0:
            log.warning("netns_delete_failed", netns=name, error=err.decode().strip())


def release_leases(state_dir: Path, netns: str) -> None:
    """Frees the link addresses a (reaped) machine's namespace held."""
    leases = state_dir / "net-leases"
    for lease in leases.iterdir() if leases.exists() else []:
        try:
            if lease.read_text() == netns:
                lease.unlink(missing_ok=True)
        except OSError:
            continue


def host_addresses(uplink_netns: str | None) -> list[str]:
    """Every address configured in the uplink namespace (the floor's "host's own addresses")."""
    argv = ["ip", *(["-n", uplink_netns] if uplink_netns else []), "-j", "addr", "show"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
    found = []
    for link in json.loads(out or "[]"):
        for info in link.get("addr_info", []):
            if "local" in info:
                found.append(str(ipaddress.ip_address(info["local"].split("%")[0])))
    return found
