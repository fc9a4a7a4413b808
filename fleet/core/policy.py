"""The egress audit for security reviewers: findings (text, JSON, SARIF), plain-words
explanation, and diffs, over the egress model in `fleet.core.egress`.

The audit reads a Smolfile's raw TOML (not only the validated model), so a file the strict
parser would refuse still gets findings with file and line instead of one parse error.
"""

from __future__ import annotations

import enum
import fnmatch
import ipaddress
import tomllib
from collections.abc import Iterable
from typing import Any

from publicsuffixlist import PublicSuffixList
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleet.core.egress import FLOOR, PRIVATE, Address, covers, reserved_range
from fleet.core.errors import InvalidArgument
from fleet.core.hostnames import embedded_addresses, numeric_ipv4, special_name, wildcard_service
from fleet.core.smolfile import allow_cidr, check_host_name, key_lines, parse_smolfile


class Severity(enum.IntEnum):
    LOW = 1
    MEDIUM = 2
    HIGH = 3

    def __str__(self) -> str:
        return self.name.lower()


_psl: PublicSuffixList | None = None


def _suffixes() -> PublicSuffixList:
    global _psl
    if _psl is None:
        _psl = PublicSuffixList()
    return _psl


class RuleInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    severity: Severity
    summary: str


RULES = {
    r.id: r
    for r in (
        RuleInfo(
            id="FLEET001",
            severity=Severity.HIGH,
            summary="open egress: net = true without an allowlist",
        ),
        RuleInfo(
            id="FLEET002",
            severity=Severity.HIGH,
            summary="allowlist entry is a public suffix or bare top-level domain",
        ),
        RuleInfo(id="FLEET003", severity=Severity.MEDIUM, summary="IP literal in allow_hosts"),
        RuleInfo(
            id="FLEET004", severity=Severity.MEDIUM, summary="CIDR wider than the allowed prefix"
        ),
        RuleInfo(
            id="FLEET005",
            severity=Severity.HIGH,
            summary="CIDR covers loopback, link-local or metadata addresses",
        ),
        RuleInfo(
            id="FLEET006", severity=Severity.MEDIUM, summary="CIDR covers private address space"
        ),
        RuleInfo(
            id="FLEET007",
            severity=Severity.HIGH,
            summary="credential bound to a host outside the allowlist",
        ),
        RuleInfo(
            id="FLEET008",
            severity=Severity.MEDIUM,
            summary="[secrets] in a file meant to be shared",
        ),
        RuleInfo(
            id="FLEET009", severity=Severity.LOW, summary="duplicate or shadowed allowlist entry"
        ),
        RuleInfo(
            id="FLEET010", severity=Severity.HIGH, summary="malformed host name in an allowlist"
        ),
        RuleInfo(
            id="FLEET011",
            severity=Severity.HIGH,
            summary="entry forbidden by the organisation's policy",
        ),
        RuleInfo(
            id="FLEET012",
            severity=Severity.MEDIUM,
            summary="entry the organisation's policy requires is missing",
        ),
        RuleInfo(
            id="FLEET013",
            severity=Severity.MEDIUM,
            summary="more allowlist entries than the organisation allows",
        ),
        RuleInfo(id="FLEET014", severity=Severity.HIGH, summary="the Smolfile is not valid"),
        RuleInfo(
            id="FLEET015",
            severity=Severity.HIGH,
            summary="allowlist name that stands for loopback, link-local, metadata or a private "
            "address",
        ),
        RuleInfo(
            id="FLEET016",
            severity=Severity.HIGH,
            summary="allowlist name under a wildcard DNS service (resolves to any address)",
        ),
    )
}


class Finding(BaseModel):
    model_config = ConfigDict(frozen=True)

    file: str
    line: int | None
    rule: str
    severity: Severity
    message: str


class OrgPolicy(BaseModel):
    """An organisation's egress rules, from a TOML file (see smolfiles/org-policy.example.toml)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    forbid_hosts: list[str] = Field(default_factory=list)
    """Names that no Smolfile may allow, nor any of their subdomains."""
    require_hosts: list[str] = Field(default_factory=list)
    """Names every Smolfile with egress must list (an internal mirror, say)."""
    max_hosts: int | None = None
    """Most allow_hosts entries one Smolfile may have."""
    max_cidr_prefix_v4: int = 16
    """A CIDR wider than this (a smaller prefix length) is flagged."""
    max_cidr_prefix_v6: int = 48
    max_cidr_total_prefix_v4: int = 12
    """All of a Smolfile's IPv4 CIDRs together may span at most as much as one CIDR of this
    prefix length (a /12: 1,048,576 addresses), however they are split into entries."""
    max_cidr_total_prefix_v6: int = 44
    allow_open_egress: bool = False
    """Whether net = true without an allowlist is acceptable at all."""
    shared: list[str] = Field(default_factory=lambda: ["smolfiles/*", "*/smolfiles/*"])
    """Glob patterns of files meant to be shared (no [secrets] in them)."""


def load_org_policy(path: str) -> OrgPolicy:
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgument(f"{path}: cannot read org policy: {exc}") from exc
    try:
        return OrgPolicy.model_validate(data.get("egress", {}) | data.get("files", {}))
    except ValidationError as exc:
        raise InvalidArgument(f"{path}: bad org policy: {exc}") from exc


def _address_of(value: str) -> Address | None:
    """The address an allow_hosts entry is, in any spelling a resolver reads as one."""
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        return numeric_ipv4(value)


def _reserved(ip: Address) -> str | None:
    found = reserved_range(ip)
    return None if found is None else f"{found[0]}, {found[1]}"


def audit_text(text: str, name: str, org: OrgPolicy | None = None) -> list[Finding]:
    """Findings for one Smolfile's text."""
    org = org or OrgPolicy()
    lines = key_lines(text)
    out: list[Finding] = []

    def add(rule: str, path: tuple[str, ...], message: str) -> None:
        line = None
        while path and line is None:
            line, path = lines.get(path), path[:-1]
        out.append(
            Finding(file=name, line=line, rule=rule, severity=RULES[rule].severity, message=message)
        )

    try:
        data: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        add("FLEET014", (), f"malformed TOML: {exc}")
        return out
    try:
        parse_smolfile(text, name)
    except InvalidArgument as exc:
        add("FLEET014", (), exc.message)
    raw_network = data.get("network")
    network: dict[str, Any] = raw_network if isinstance(raw_network, dict) else {}
    hosts = [h for h in network.get("allow_hosts", []) if isinstance(h, str)]
    cidrs = [c for c in network.get("allow_cidrs", []) if isinstance(c, str)]
    hpath, cpath = ("network", "allow_hosts"), ("network", "allow_cidrs")

    if data.get("net") is True and not hosts and not cidrs and not org.allow_open_egress:
        add(
            "FLEET001",
            ("net",),
            "net = true with no allow_hosts or allow_cidrs: the machine can reach anything",
        )

    seen: dict[str, str] = {}
    for host in hosts:
        low = host.lower().rstrip(".")
        if low in seen:
            first = seen[low]
            why = "" if first == host else f" (as {first!r}: case and a trailing dot aside)"
            add("FLEET009", hpath, f"{host!r} is listed twice{why}")
            continue
        seen[low] = host
        address = _address_of(low)
        if address is not None:
            spelled = "" if str(address) == low else f" (spelled as a number: {address})"
            add(
                "FLEET003",
                hpath,
                f"{host!r} is an IP address{spelled}; list it in allow_cidrs as /32 or /128",
            )
            reserved = _reserved(address)
            if reserved:
                add("FLEET015", hpath, f"{host!r} is {address} ({reserved})")
            continue
        try:
            check_host_name(host)
        except ValueError:
            add("FLEET010", hpath, f"{host!r} is not a valid host name")
            continue
        bare = low.removeprefix("*.")
        if "." not in bare or _suffixes().is_public(bare):
            add(
                "FLEET002",
                hpath,
                f"{host!r} is a public suffix: it allows every domain registered under it",
            )
        special = special_name(low)
        if special:
            add("FLEET015", hpath, f"{host!r} reaches {special}")
        service = wildcard_service(low)
        if service:
            add(
                "FLEET016",
                hpath,
                f"{host!r} is under {service}, a wildcard DNS service: it and its subdomains "
                f"resolve to whatever address their names spell (10.0.0.1.{service} is "
                "10.0.0.1)",
            )
            for embedded in embedded_addresses(low.removesuffix(service)):
                reserved = _reserved(embedded)
                if reserved:
                    add("FLEET015", hpath, f"{host!r} resolves to {embedded} ({reserved})")
        shadow = next((o for o in hosts if o.lower().rstrip(".") != low and covers(low, o)), None)
        if shadow:
            add(
                "FLEET009",
                hpath,
                f"{host!r} is already allowed by {shadow!r} (subdomains are included)",
            )
        for forbidden in org.forbid_hosts:
            if covers(low, forbidden) or covers(forbidden, low):
                add(
                    "FLEET011",
                    hpath,
                    f"{host!r} overlaps {forbidden!r}, which the organisation forbids",
                )
    if org.max_hosts is not None and len(hosts) > org.max_hosts:
        add(
            "FLEET013",
            hpath,
            f"{len(hosts)} allow_hosts entries; the organisation allows {org.max_hosts}",
        )
    if hosts or cidrs:
        for required in org.require_hosts:
            if not any(covers(required, h) for h in hosts):
                add("FLEET012", hpath, f"{required!r} is required by the organisation's policy")

    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    listed: set[ipaddress.IPv4Network | ipaddress.IPv6Network] = set()
    for cidr in cidrs:
        try:
            net = allow_cidr(cidr)
        except ValueError:
            add("FLEET014", cpath, f"{cidr[:100]!r} is not a CIDR range")
            continue
        if str(net) != cidr:  # (an IPv4-mapped range: judged, and enforced, as IPv4)
            cidr = f"{cidr} (that is, {net})"
        if net in listed:
            add("FLEET009", cpath, f"{cidr!r} is listed twice")
            continue
        # (by its supernets: linear in the entries, so a long list is judged quickly)
        inside = next(
            (up for q in range(net.prefixlen - 1, -1, -1)
             if (up := net.supernet(new_prefix=q)) in listed),
            None,
        )  # fmt: skip
        if inside:
            add("FLEET009", cpath, f"{cidr!r} is inside {inside} already listed")
        nets.append(net)
        listed.add(net)
        limit = org.max_cidr_prefix_v4 if net.version == 4 else org.max_cidr_prefix_v6
        if net.prefixlen < limit:
            add("FLEET004", cpath, f"{cidr!r} spans /{net.prefixlen}, wider than /{limit}")
        for floor, what in FLOOR:
            f = ipaddress.ip_network(floor)
            if f.version == net.version and net.overlaps(f):
                add(
                    "FLEET005",
                    cpath,
                    f"{cidr!r} covers {floor} ({what}); the floor still blocks it, but the entry says otherwise",
                )
                break
        for private, what in PRIVATE:
            p = ipaddress.ip_network(private)
            if p.version == net.version and net.overlaps(p):
                add(
                    "FLEET006",
                    cpath,
                    f"{cidr!r} covers {private} ({what}): internal services become reachable",
                )
                break

    for version, limit in ((4, org.max_cidr_total_prefix_v4), (6, org.max_cidr_total_prefix_v6)):
        mine = [n for n in nets if n.version == version]
        bits = 32 if version == 4 else 128
        total = sum(n.num_addresses for n in ipaddress.collapse_addresses(mine))  # type: ignore[type-var, misc]
        if len(mine) > 1 and total > 2 ** (bits - limit):
            share = total / 2**bits * 100
            add(
                "FLEET004",
                cpath,
                f"{len(mine)} allow_cidrs entries together span {total:,} IPv{version} addresses "
                f"({share:.3g}% of IPv{version}), more than one /{limit}",
            )

    for index, cred in enumerate(
        network.get("credentials", []) if isinstance(network.get("credentials"), list) else []
    ):
        for target in cred.get("allowed_hosts", []) if isinstance(cred, dict) else []:
            if not any(covers(str(target), h) for h in hosts):
                add(
                    "FLEET007",
                    ("network", "credentials"),
                    f"credentials[{index}] ({cred.get('name', '?')}) is sent to {target!r}, which allow_hosts does not allow",
                )

    if data.get("secrets") and any(fnmatch.fnmatch(name, pattern) for pattern in org.shared):
        add(
            "FLEET008",
            ("secrets",),
            "[secrets] in a shared file: keep secret references in a local Smolfile",
        )
    return sorted(out, key=lambda f: (f.line or 0, f.rule, f.message))


def at_or_above(findings: Iterable[Finding], severity: Severity) -> list[Finding]:
    return [f for f in findings if f.severity >= severity]


def explain(text: str, name: str) -> list[str]:
    """The effective egress policy of a Smolfile, in plain words."""
    spec = parse_smolfile(text, name).spec
    lines = key_lines(text)
    net = spec.network
    hosts = list(net.allow_hosts) if net else []
    cidrs = list(net.allow_cidrs) if net else []
    out = [f"{name}:"]
    if not spec.net and not hosts and not cidrs:
        out.append(
            "  Networking is off: the machine has only its own loopback; nothing outside is reachable."
        )
        return out
    if spec.net and not hosts and not cidrs:
        out.append(
            f"  Open egress (net = true, line {lines.get(('net',))}): any address outside the floor below is reachable."
        )
    else:
        out.append(
            "  Egress is limited to this allowlist; every other name gets NXDOMAIN and every other address is refused:"
        )
        for host in hosts:
            out.append(
                f"    - {host} and all of its subdomains (allow_hosts, line {lines.get(('network', 'allow_hosts'))}), "
                "at the addresses its DNS answers give, for their TTL"
            )
        for cidr in cidrs:
            out.append(
                f"    - addresses in {cidr} (allow_cidrs, line {lines.get(('network', 'allow_cidrs'))})"
            )
        for cred in net.credentials if net else []:
            out.append(
                f"    - credential {cred.name} (env {cred.environment_variable}) is substituted only in "
                f"HTTPS headers to {', '.join(cred.allowed_hosts)}"
            )
    out.append("  The floor blocks, whatever the allowlist says:")
    for cidr, what in FLOOR:
        out.append(f"    - {cidr}: {what}")
    out.append("    - the host's own addresses")
    out.append(
        "    - private ranges (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7) unless listed in allow_cidrs"
    )
    out.append("    - any allowlisted name whose DNS answer falls in the floor (DNS rebinding)")
    out.append(
        "  Enforcement: the smol runtime applies this allowlist in the engine; the namespace "
        "runtime gives the machine its own network namespace, an nftables firewall and fleet's "
        "DNS forwarder. Refused queries and connections are listed by `fleet egress-events`."
    )
    return out


def diff(old_text: str, old_name: str, new_text: str, new_name: str) -> list[str]:
    """The egress a change adds and removes, for code review."""
    old = parse_smolfile(old_text, old_name).spec
    new = parse_smolfile(new_text, new_name).spec

    def entries(spec: Any) -> set[str]:
        n = spec.network
        out = {f"host {h}" for h in (n.allow_hosts if n else [])}
        out |= {f"cidr {c}" for c in (n.allow_cidrs if n else [])}
        if spec.net and not out:
            out.add("open egress (net = true, no allowlist)")
        return out

    before, after = entries(old), entries(new)
    added, removed = sorted(after - before), sorted(before - after)
    lines = [f"egress diff {old_name} -> {new_name}:"]
    lines += [f"  + {e}" for e in added]
    lines += [f"  - {e}" for e in removed]
    if not added and not removed:
        lines.append("  no change in what the machine can reach")
    return lines


def to_sarif(findings: Iterable[Finding]) -> dict[str, Any]:
    """SARIF 2.1.0, so code-scanning tools show the findings on the lines they name."""
    level = {1: "note", 2: "warning", 3: "error"}
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "fleet policy audit",
                        "rules": [
                            {
                                "id": r.id,
                                "shortDescription": {"text": r.summary},
                                "defaultConfiguration": {"level": level[int(r.severity)]},
                            }
                            for r in RULES.values()
                        ],
                    }
                },
                "results": [
                    {
                        "ruleId": f.rule,
                        "level": level[int(f.severity)],
                        "message": {"text": f.message},
                        "locations": [
                            {
                                "physicalLocation": {
                                    "artifactLocation": {"uri": f.file},
                                    "region": {"startLine": f.line or 1},
                                }
                            }
                        ],
                    }
                    for f in findings
                ],
            }
        ],
    }
