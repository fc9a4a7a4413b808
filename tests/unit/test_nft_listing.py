"""Reading refused connections back from `nft -j list table inet fleet` output."""

from __future__ import annotations

import json

import pytest

from fleet.runtime.netns import REFUSED_SETS, parse_refused


def listing(*sets: dict[str, object]) -> str:
    """A listing as nft 1.0's JSON writes it: metainfo, the table, then its sets."""
    return json.dumps({"nftables": [
        {"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
        {"table": {"family": "inet", "name": "fleet", "handle": 1}},
        *({"set": {"family": "inet", "table": "fleet", **s}} for s in sets),
    ]})  # fmt: skip


LISTING = listing(
    {"name": "dns4", "type": "ipv4_addr", "flags": ["timeout"],
     "elem": [{"elem": {"val": "93.184.216.34", "timeout": 300, "expires": 290}}]},
    {"name": "refused_tcp", "type": ["ipv4_addr", "inet_service"], "size": 65535,
     "flags": ["timeout"], "timeout": 3600,
     "elem": [{"elem": {"val": {"concat": ["198.51.100.2", 80]}, "expires": 3590}},
              {"elem": {"val": {"concat": ["203.0.113.7", 443]}, "timeout": 7200,
                        "expires": 7140}}]},
    {"name": "refused_udp", "type": ["ipv4_addr", "inet_service"], "timeout": 3600},
    {"name": "refused_ip", "type": "ipv4_addr", "timeout": 3600, "elem": ["192.0.2.9"]},
)  # fmt: skip


def test_refusals_carry_when_they_happened() -> None:
    now = 10_000.0
    sets = parse_refused(LISTING, now)
    assert set(sets) == set(REFUSED_SETS)  # (the DNS set is not a refusal)
    # The set's default timeout (1h) applies where an element shows none.
    assert sets["refused_tcp"] == [("198.51.100.2:80", pytest.approx(now - 10)),
                                   ("203.0.113.7:443", pytest.approx(now - 60))]  # fmt: skip
    assert sets["refused_udp"] == []
    assert sets["refused_ip"] == [("192.0.2.9", now)]  # (a bare element: no expiry shown)


def test_a_listing_without_sets_has_none() -> None:
    assert parse_refused(listing(), 0.0) == {}


@pytest.mark.parametrize(
    "bad",
    ["not json", '{"tables": []}', listing({"name": "refused_tcp", "elem": [{"elem": {}}]})],
)
def test_an_unreadable_listing_is_refused_saying_so(bad: str) -> None:
    with pytest.raises(ValueError, match="unreadable `nft -j` listing"):
        parse_refused(bad, 0.0)
