"""The egress audit sees through spellings: numeric IPv4 forms, wildcard-DNS names, metadata
and loopback names, trailing dots and IPv4-mapped IPv6 ranges; and an allow_cidrs entry means
the same to the audit as to the rules that enforce it."""

from __future__ import annotations

import ipaddress

import pytest

from fleet.core.egress import EgressMode, EgressRules, effective_egress
from fleet.core.hostnames import embedded_addresses, numeric_ipv4
from fleet.core.policy import Finding, audit_text
from fleet.core.smolfile import parse_smolfile
from fleet.runtime.netns import ruleset


def hosts(*names: str) -> str:
    listed = ", ".join(f'"{n}"' for n in names)
    return f'image = "minimal"\nnet = true\n[network]\nallow_hosts = [{listed}]\n'


def cidrs(*ranges: str) -> str:
    listed = ", ".join(f'"{r}"' for r in ranges)
    return f'image = "minimal"\nnet = true\n[network]\nallow_cidrs = [{listed}]\n'


def rules_of(findings: list[Finding]) -> set[str]:
    return {f.rule for f in findings}


@pytest.mark.parametrize(
    ("name", "address"),
    [("0x7f.0.0.1", "127.0.0.1"), ("2130706433", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"),
     ("127.1", "127.0.0.1"), ("0x7f000001", "127.0.0.1"), ("10.1", "10.0.0.1"),
     ("192.168.257", "192.168.1.1"), ("0", "0.0.0.0"), ("0xa9.254.169.254", "169.254.169.254"),
     ("8.8.8.8", "8.8.8.8")],
)  # fmt: skip
def test_numeric_spellings_are_read_as_resolvers_read_them(name: str, address: str) -> None:
    assert numeric_ipv4(name) == ipaddress.IPv4Address(address)


@pytest.mark.parametrize(
    "name", ["example.com", "08.0.0.1", "256.0.0.1", "1.2.3.4.5", "1.2.16777216", "0xg", "", "a1"]
)
def test_names_and_out_of_range_numbers_are_not_addresses(name: str) -> None:
    assert numeric_ipv4(name) is None


@pytest.mark.parametrize("name", ["0x7f.0.0.1", "2130706433", "0177.0.0.1", "127.1"])
def test_an_odd_spelling_of_loopback_in_allow_hosts_is_flagged_as_loopback(name: str) -> None:
    findings = audit_text(hosts(name), "s.smolfile")
    assert rules_of(findings) == {"FLEET003", "FLEET015"}
    messages = " ".join(f.message for f in findings)
    assert "spelled as a number: 127.0.0.1" in messages and "IPv4 loopback" in messages
    assert all(f.line == 4 for f in findings)


def test_a_numeric_spelling_of_a_public_address_is_an_ip_literal_only() -> None:
    findings = audit_text(hosts("134744072"), "s.smolfile")  # 8.8.8.8
    assert rules_of(findings) == {"FLEET003"}
    assert "spelled as a number: 8.8.8.8" in findings[0].message


@pytest.mark.parametrize(
    ("name", "address", "what"),
    [("10.0.0.1.nip.io", "10.0.0.1", "private range"),
     ("app-192-168-0-1.sslip.io", "192.168.0.1", "private range"),
     ("app.127.0.0.1.xip.io", "127.0.0.1", "IPv4 loopback"),
     ("svc-a9fea9fe.nip.io", "169.254.169.254", "cloud metadata service"),
     ("0--1.sslip.io", "::1", "IPv6 loopback"),
     ("*.172-16-3-4.traefik.me", "172.16.3.4", "private range")],
)  # fmt: skip
def test_a_wildcard_dns_name_embedding_a_reserved_address_is_flagged(
    name: str, address: str, what: str
) -> None:
    findings = audit_text(hosts(name), "s.smolfile")
    assert rules_of(findings) == {"FLEET015", "FLEET016"}
    reached = next(f for f in findings if f.rule == "FLEET015")
    assert f"resolves to {address} (" in reached.message and what in reached.message


@pytest.mark.parametrize("name", ["nip.io", "*.sslip.io", "8.8.8.8.nip.io", "app.xip.io"])
def test_any_name_under_a_wildcard_dns_service_is_flagged(name: str) -> None:
    """Its subdomains are allowed too, and they can spell any address."""
    findings = audit_text(hosts(name), "s.smolfile")
    assert "FLEET016" in rules_of(findings)
    assert "wildcard DNS service" in next(f for f in findings if f.rule == "FLEET016").message


def test_embedded_addresses_are_read_in_every_form_the_services_use() -> None:
    found = embedded_addresses("a.10-0-0-1.b-7f000001.2a01-4f8--2")
    assert found == [
        ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("2a01:4f8::2"),
    ]  # fmt: skip
    assert embedded_addresses("plain.example") == []


@pytest.mark.parametrize(
    ("name", "why"),
    [("metadata.google.internal", "metadata.google.internal"),
     ("google.internal", "metadata.google.internal"), ("metadata.goog", "metadata.goog"),
     ("instance-data.ec2.internal", "instance-data.ec2.internal"),
     ("localhost", "loopback"), ("api.localhost", "loopback"), ("lvh.me", "loopback")],
)  # fmt: skip
def test_metadata_and_loopback_names_are_flagged(name: str, why: str) -> None:
    findings = audit_text(hosts(name), "s.smolfile")
    reached = [f for f in findings if f.rule == "FLEET015"]
    assert len(reached) == 1 and why in reached[0].message, findings


def test_a_trailing_dot_does_not_make_an_entry_shadow_itself() -> None:
    assert audit_text(hosts("example.com."), "s.smolfile") == []
    twice = audit_text(hosts("example.com.", "Example.com"), "s.smolfile")
    assert [(f.rule, f.message) for f in twice] == [(
        "FLEET009",
        "'Example.com' is listed twice (as 'example.com.': case and a trailing dot aside)",
    )]  # fmt: skip
    shadowed = audit_text(hosts("example.com.", "api.example.com"), "s.smolfile")
    assert [f.message for f in shadowed] == [
        "'api.example.com' is already allowed by 'example.com.' (subdomains are included)"
    ]


@pytest.mark.parametrize(
    ("entry", "rule", "covered"),
    [("::ffff:10.0.0.0/104", "FLEET006", "10.0.0.0/8"),
     ("::ffff:192.168.1.0/120", "FLEET006", "192.168.0.0/16"),
     ("::ffff:127.0.0.1", "FLEET005", "127.0.0.0/8"),
     ("::ffff:169.254.169.254/128", "FLEET005", "169.254.169.254/32"),
     ("64:ff9b::a00:0/104", "FLEET006", "64:ff9b::a00:0/104")],
)  # fmt: skip
def test_ipv4_mapped_and_nat64_ranges_are_judged_as_the_ipv4_ranges_they_reach(
    entry: str, rule: str, covered: str
) -> None:
    findings = audit_text(cidrs(entry), "s.smolfile")
    flagged = [f for f in findings if f.rule == rule]
    assert len(flagged) == 1 and f"covers {covered} (" in flagged[0].message, findings


def test_a_mapped_range_and_its_ipv4_range_are_one_entry() -> None:
    findings = audit_text(cidrs("10.0.0.0/8", "::ffff:10.0.0.0/104"), "s.smolfile")
    assert "'::ffff:10.0.0.0/104 (that is, 10.0.0.0/8)' is listed twice" in [
        f.message for f in findings if f.rule == "FLEET009"
    ]


def test_a_mapped_range_is_enforced_as_the_ipv4_range_the_audit_judged() -> None:
    """The Smolfile reads `::ffff:10.0.0.0/104` as 10.0.0.0/8, and so do the DNS forwarder's
    checks and the firewall: the range is reachable in either spelling; without it, neither
    spelling of a private address is."""
    spec = parse_smolfile(cidrs("::ffff:10.0.0.0/104")).spec
    assert spec.network is not None and spec.network.allow_cidrs == ["10.0.0.0/8"]
    rules = EgressRules.of(effective_egress(spec, "namespace"))
    assert rules.mode == EgressMode.ALLOWLIST
    assert rules.address_refusal("10.1.2.3") is None
    assert rules.address_refusal("::ffff:10.1.2.3") is None
    assert "10.0.0.0/8" not in rules.private_floor()
    table = ruleset(rules, None)
    assert "set cidr4 { type ipv4_addr; flags interval; elements = { 10.0.0.0/8 } }" in table

    closed = EgressRules(mode=EgressMode.OPEN)
    assert closed.floor_refusal("::ffff:10.0.0.1") == "private range, not listed in allow_cidrs"
    assert closed.answer_refusal("x.example", "64:ff9b::a00:1") is not None
    assert closed.floor_refusal("::ffff:127.0.0.1") is not None
