"""Reading refused connections back from `nft list table inet fleet` output."""

from __future__ import annotations

import pytest

from fleet.runtime.netns import REFUSED_SETS, parse_refused, split_sets

# As nft 1.0 prints it: elements over several lines, then the chains with addresses of their own.
LISTING = """table inet fleet {
\tset dns4 {
\t\ttype ipv4_addr
\t\tflags timeout
\t\telements = { 93.184.216.34 timeout 5m expires 4m50s }
\t}

\tset refused_tcp {
\t\ttype ipv4_addr . inet_service
\t\tsize 65535
\t\tflags dynamic,timeout
\t\ttimeout 1h
\t\telements = { 198.51.100.2 . 80 expires 59m50s,
\t\t\t     203.0.113.7 . 443 timeout 2h expires 1h59m }
\t}

\tset refused_udp {
\t\ttype ipv4_addr . inet_service
\t\tsize 65535
\t\tflags dynamic,timeout
\t\ttimeout 1h
\t}

\tset refused_ip {
\t\ttype ipv4_addr
\t\tsize 65535
\t\tflags dynamic,timeout
\t\ttimeout 1h
\t\telements = { 192.0.2.9 expires 59m59s500ms }
\t}

\tchain output {
\t\ttype filter hook output priority filter; policy drop;
\t\tip daddr 100.96.0.1 tcp dport 9000 accept
\t}
}
"""


def test_each_set_is_cut_at_its_own_closing_brace() -> None:
    sets = split_sets(LISTING)
    assert set(REFUSED_SETS) <= set(sets)
    assert "100.96.0.1" not in sets["refused_ip"]  # the chain after it is not part of it
    assert "93.184.216.34" in sets["dns4"] and "93.184.216.34" not in sets["refused_tcp"]


def test_refusals_carry_when_they_happened() -> None:
    sets = split_sets(LISTING)
    now = 10_000.0
    tcp = parse_refused(sets["refused_tcp"], now)
    # The set's default timeout (1h) applies where an element shows none.
    assert tcp == [("198.51.100.2:80", pytest.approx(now - 10)),
                   ("203.0.113.7:443", pytest.approx(now - 60))]  # fmt: skip
    assert parse_refused(sets["refused_udp"], now) == []
    assert parse_refused(sets["refused_ip"], now) == [("192.0.2.9", pytest.approx(now - 0.5))]


def test_a_listing_without_sets_has_none() -> None:
    assert split_sets("table inet fleet {\n}\n") == {}
