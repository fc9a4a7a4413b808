"""Egress decisions: which names a machine may resolve and which addresses it may reach.

Pure rules shared by the DNS forwarder, the firewall generator and the audit tools. The floor
(cloud metadata, link-local, loopback, the host's own addresses) is never lifted; private
ranges are reachable only where `allow_cidrs` lists them.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Iterable
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict

from fleet.core.smolfile import Smolfile, allow_cidr

# What no allowlist lifts: cloud metadata, link-local, loopback, and the host itself.
_FLOOR_BASE = (
    ("169.254.169.254/32", "cloud metadata service (IPv4)"),
    ("fd00:ec2::254/128", "cloud metadata service (IPv6)"),
    ("169.254.0.0/16", "IPv4 link-local"),
    ("fe80::/10", "IPv6 link-local"),
    ("127.0.0.0/8", "IPv4 loopback (the machine itself)"),
    ("::1/128", "IPv6 loopback"),
)


def ipv6_forms(cidr: str, what: str) -> list[tuple[str, str]]:
    """The IPv6 spellings of an IPv4 range: IPv4-mapped (::ffff:a.b.c.d), NAT64
    (64:ff9b::a.b.c.d) and 6to4 (2002:AABB:CCDD::), each of which reaches the IPv4 address
    where the path translates it."""
    net = ipaddress.ip_network(cidr)
    if net.version != 4:
        return []
    v4, plen = int(net.network_address), net.prefixlen
    return [
        (str(ipaddress.IPv6Network(((0xFFFF << 32) | v4, 96 + plen))), f"{what}, IPv4-mapped"),
        (str(ipaddress.IPv6Network(((0x64FF9B << 96) | v4, 96 + plen))), f"{what}, NAT64"),
        (str(ipaddress.IPv6Network(((0x2002 << 112) | (v4 << 80), 16 + plen))), f"{what}, 6to4"),
    ]


FLOOR = (*_FLOOR_BASE, *[form for c, w in _FLOOR_BASE for form in ipv6_forms(c, w)])
"""Never reachable, whatever a Smolfile allows: in every spelling, IPv6 forms of the IPv4
ranges included."""
_PRIVATE_BASE = (
    ("10.0.0.0/8", "private range"),
    ("172.16.0.0/12", "private range"),
    ("192.168.0.0/16", "private range"),
    ("100.64.0.0/10", "carrier-grade NAT range"),
    ("fc00::/7", "IPv6 unique-local range"),
)
PRIVATE = (*_PRIVATE_BASE, *[form for c, w in _PRIVATE_BASE for form in ipv6_forms(c, w)])
"""Reachable only where allow_cidrs lists them: in every spelling, as the floor."""

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_FLOOR = tuple((ipaddress.ip_network(cidr), what) for cidr, what in FLOOR)
_PRIVATE = tuple((ipaddress.ip_network(cidr), what) for cidr, what in PRIVATE)
# Never a destination: "this network", multicast and broadcast.
_NEVER = tuple(
    (ipaddress.ip_network(cidr), what)
    for cidr, what in (
        ("0.0.0.0/8", "'this network' range"),
        ("224.0.0.0/4", "IPv4 multicast"),
        ("255.255.255.255/32", "IPv4 broadcast"),
        ("ff00::/8", "IPv6 multicast"),
        ("::/128", "IPv6 unspecified address"),
    )
)


class EgressMode(enum.StrEnum):
    OFF = "off"
    ALLOWLIST = "allowlist"
    OPEN = "open"


class EffectiveEgress(BaseModel):
    """The egress a machine actually had, recorded with each rollout for review."""

    model_config = ConfigDict(frozen=True)

    mode: EgressMode
    allow_hosts: tuple[str, ...] = ()
    allow_cidrs: tuple[str, ...] = ()
    enforced_by: str = ""

    def could_reach(self, host: str) -> bool:
        """Whether this machine could have reached `host` (a name)."""
        if self.mode == EgressMode.OPEN:
            return True
        if self.mode == EgressMode.OFF:
            return False
        return any(covers(host, allowed) for allowed in self.allow_hosts)


def effective_egress(spec: Smolfile, runtime: str) -> EffectiveEgress:
    """What a runtime enforces for a Smolfile's network settings."""
    net = spec.network
    hosts = tuple(net.allow_hosts) if net else ()
    cidrs = tuple(net.allow_cidrs) if net else ()
    how = (
        "network namespace, nftables and fleet's DNS forwarder"
        if runtime == "namespace"
        else "allow_hosts/allow_cidrs in the engine"
    )
    if hosts or cidrs:
        return EffectiveEgress(
            mode=EgressMode.ALLOWLIST, allow_hosts=hosts, allow_cidrs=cidrs,
            enforced_by=f"{runtime} runtime: {how}",
        )  # fmt: skip
    if spec.net:
        return EffectiveEgress(
            mode=EgressMode.OPEN, enforced_by=f"{runtime} runtime: open egress above the floor"
        )
    return EffectiveEgress(mode=EgressMode.OFF, enforced_by=f"{runtime} runtime: networking off")


class EgressEvent(BaseModel):
    """One refused DNS query or connection, as recorded in the ledger."""

    model_config = ConfigDict(frozen=True)

    at: float
    machine: str
    kind: Literal["dns", "connect"]
    destination: str
    decision: Literal["refused"] = "refused"
    reason: str


def as_ipv4(ip: Address) -> Address:
    """An IPv4-mapped IPv6 address (::ffff:a.b.c.d) as the IPv4 address it reaches; any other
    address as it is. Every check reads an address through this, so that no spelling of an
    IPv4 address is judged apart from it."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def reserved_range(ip: Address) -> tuple[Network, str] | None:
    """The floor or private range `ip` falls in, and what it is (None: a public address)."""
    ip = as_ipv4(ip)
    for net, what in (*_FLOOR, *_NEVER, *_PRIVATE):
        if ip.version == net.version and ip in net:
            return net, what
    return None


def covers(name: str, pattern: str) -> bool:
    """Whether allowing `pattern` allows `name` (a name and its subdomains)."""
    name, pattern = name.lower().rstrip("."), pattern.lower().removeprefix("*.").rstrip(".")
    return name == pattern or name.endswith("." + pattern)


class EgressRules(BaseModel):
    """One machine's egress: its mode, allowlist, and the host addresses it must not reach."""

    model_config = ConfigDict(frozen=True)

    mode: EgressMode
    allow_hosts: tuple[str, ...] = ()
    allow_cidrs: tuple[str, ...] = ()
    host_addresses: tuple[str, ...] = ()

    @classmethod
    def of(cls, egress: EffectiveEgress, host_addresses: Iterable[str] = ()) -> EgressRules:
        return cls(
            mode=egress.mode,
            allow_hosts=egress.allow_hosts,
            allow_cidrs=egress.allow_cidrs,
            host_addresses=tuple(sorted(set(host_addresses))),
        )

    @cached_property
    def networks(self) -> tuple[Network, ...]:
        """allow_cidrs, parsed once (the rules are frozen)."""
        return tuple(allow_cidr(c) for c in self.allow_cidrs)

    def name_refusal(self, name: str) -> str | None:
        """Why a DNS query for `name` is refused, or None when it may be resolved."""
        if self.mode == EgressMode.OFF:
            return "networking is off for this machine"
        if self.mode == EgressMode.OPEN:
            return None
        if any(covers(name, allowed) for allowed in self.allow_hosts):
            return None
        return "not in allow_hosts"

    def floor_refusal(self, address: str) -> str | None:
        """Why no allowlist can make `address` reachable, or None (the floor and private ranges).

        A private range is refused unless an `allow_cidrs` entry covers the address.
        """
        ip = as_ipv4(ipaddress.ip_address(address))
        if address in self.host_addresses or str(ip) in self.host_addresses:
            return "the host's own address"
        for net, what in (*_FLOOR, *_NEVER):
            if ip.version == net.version and ip in net:
                return what
        for net, what in _PRIVATE:
            if ip.version == net.version and ip in net:
                if any(ip.version == c.version and ip in c for c in self.networks):
                    return None
                return f"{what}, not listed in allow_cidrs"
        return None

    def address_refusal(self, address: str) -> str | None:
        """Why a connection to the IP literal `address` is refused, or None when allowed."""
        if self.mode == EgressMode.OFF:
            return "networking is off for this machine"
        floor = self.floor_refusal(address)
        if floor is not None:
            return floor
        ip = as_ipv4(ipaddress.ip_address(address))
        if self.mode == EgressMode.OPEN:
            return None
        if any(ip.version == c.version and ip in c for c in self.networks):
            return None
        return "not in allow_cidrs (and not an answer for an allowed name)"

    def answer_refusal(self, name: str, address: str) -> str | None:
        """Why an upstream answer `name → address` is refused (DNS rebinding), or None."""
        floor = self.floor_refusal(address)
        if floor is not None:
            return f"{name} resolved to {address}: {floor} (DNS rebinding refused)"
        return None

    def hard_floor(self) -> list[str]:
        """CIDRs no rule lifts, as firewall set elements (IPv4 and IPv6)."""
        nets = [net for net, _ in (*_FLOOR, *_NEVER)]
        nets += [ipaddress.ip_network(a) for a in self.host_addresses]
        return _collapsed(nets)

    def private_floor(self) -> list[str]:
        """Private ranges minus what allow_cidrs lists, as firewall set elements."""
        out: list[Network] = []
        listed = self.networks
        for net, _ in _PRIVATE:
            pieces = [net]
            for allowed in listed:
                if allowed.version != net.version:
                    continue
                next_pieces: list[Network] = []
                for piece in pieces:
                    if piece.subnet_of(allowed):  # type: ignore[arg-type]
                        continue
                    if allowed.subnet_of(piece):  # type: ignore[arg-type]
                        next_pieces += list(piece.address_exclude(allowed))  # type: ignore[arg-type]
                    else:
                        next_pieces.append(piece)
                pieces = next_pieces
            out += pieces
        return _collapsed(out)


def _collapsed(nets: list[Network]) -> list[str]:
    """Overlapping ranges merged (a firewall interval set refuses overlaps), IPv4 first."""
    v4 = ipaddress.collapse_addresses(n for n in nets if isinstance(n, ipaddress.IPv4Network))
    v6 = ipaddress.collapse_addresses(n for n in nets if isinstance(n, ipaddress.IPv6Network))
    return [str(n) for n in v4] + [str(n) for n in v6]
