"""What an allowlisted name stands for besides a DNS name: an IPv4 address spelled as a number,
a wildcard-DNS name that resolves to the address it embeds, a cloud metadata service, this host.

The egress audit reads allow_hosts through these, so that an entry that reaches loopback, the
metadata service or a private range in a roundabout spelling is flagged as if it were written
plainly. Pure: no resolver is asked.
"""

from __future__ import annotations

import ipaddress
import re

from fleet.core.egress import Address, covers

GATEWAY_NAME = "fleet-gateway.internal"
"""What a machine calls the inference gateway: its resolver answers this name with the address
the machine reaches the gateway at, and the gateway's certificate names it, so that a client in
the machine verifies the gateway over TLS by name as any client does (`.internal` is kept for
private use and resolves nowhere else)."""

MAX_NUMBER_CHARS = 40
"""Longer numeric parts are not addresses (and are not turned into large integers)."""

WILDCARD_DNS = ("nip.io", "sslip.io", "xip.io", "traefik.me")
"""Public wildcard-DNS services: a name under one resolves to the address it spells
(`10.0.0.1.nip.io`, `app-192-168-0-1.sslip.io`, `app-0a000001.nip.io`, `--1.sslip.io`), so an
entry under one allows every address, however its own name reads (its subdomains are allowed
too, and can spell any address)."""

LOOPBACK_NAMES = ("localhost", "localtest.me", "lvh.me", "vcap.me")
"""Names that, with all their subdomains, resolve to loopback by design (RFC 6761, and public
names kept pointing at 127.0.0.1)."""

METADATA_NAMES = (
    "metadata.google.internal",
    "metadata.goog",
    "instance-data",
    "instance-data.ec2.internal",
    "metadata.tencentyun.com",
    "metadata.platformequinix.com",
)
"""Names of cloud providers' instance metadata services (169.254.169.254 and its kin), which
hand out the host's credentials."""

_DECIMAL = re.compile(r"[1-9][0-9]*")
_OCTAL = re.compile(r"0[0-7]*")
_HEX = re.compile(r"0[xX][0-9a-fA-F]*")
_HEX_ADDRESS = re.compile(r"[0-9a-f]{8}")


def numeric_ipv4(name: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address `name` stands for where it is read as C's inet_aton reads it (as
    resolvers do before asking DNS): one to four parts, each decimal, octal (a leading 0) or
    hexadecimal (0x), the last filling the bytes left (`127.1`, `0x7f.0.0.1`, `0177.0.0.1`,
    `2130706433`); None when it is not such a number."""
    parts = name.rstrip(".").split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = []
    for part in parts:
        if len(part) > MAX_NUMBER_CHARS:
            return None
        if _HEX.fullmatch(part):
            values.append(int(part[2:] or "0", 16))
        elif _OCTAL.fullmatch(part):
            values.append(int(part, 8))
        elif _DECIMAL.fullmatch(part):
            values.append(int(part))
        else:
            return None
    *leading, last = values
    if any(v > 255 for v in leading) or last >= 256 ** (5 - len(values)):
        return None
    number = last
    for index, value in enumerate(leading):
        number |= value << (8 * (3 - index))
    return ipaddress.IPv4Address(number)


def wildcard_service(name: str) -> str | None:
    """The wildcard-DNS service `name` (or a `*.` entry) is, or is under, or None."""
    bare = name.lower().removeprefix("*.").rstrip(".")
    return next((s for s in WILDCARD_DNS if covers(bare, s)), None)


def embedded_addresses(name: str) -> list[Address]:
    """Every address a wildcard-DNS name may be read as spelling: four decimal parts joined by
    dots or dashes, eight hex digits, or an IPv6 address with dashes for colons (`--1`). Read
    generously, since each service parses names its own way."""
    out: list[Address] = []
    labels = name.lower().removeprefix("*.").rstrip(".").split(".")
    tokens = [t for label in labels for t in label.split("-")]
    for start in range(len(tokens) - 3):
        window = tokens[start : start + 4]
        if all(t.isdigit() and len(t) <= 3 and int(t) <= 255 for t in window):
            out.append(ipaddress.IPv4Address(".".join(str(int(t)) for t in window)))
    out += [ipaddress.IPv4Address(int(t, 16)) for t in tokens if _HEX_ADDRESS.fullmatch(t)]
    for label in labels:
        if "-" in label:
            try:
                v6 = ipaddress.ip_address(label.replace("-", ":"))
            except ValueError:
                continue
            if v6.version == 6:
                out.append(v6)
    return list(dict.fromkeys(out))


def special_name(name: str) -> str | None:
    """What `name` (an allowlist entry) reaches besides the public internet, when it is, is
    under, or covers a metadata service's or a loopback name; None otherwise."""
    bare = name.lower().removeprefix("*.").rstrip(".")
    for known in METADATA_NAMES:
        if covers(known, bare) or covers(bare, known):
            return f"the cloud metadata service ({known})"
    for known in LOOPBACK_NAMES:
        if covers(known, bare) or covers(bare, known):
            return f"loopback: {known} and its subdomains resolve to this machine"
    return None
