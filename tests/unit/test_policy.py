"""Egress audit rules, org policy, explain and diff, on Smolfile text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.core.policy import OrgPolicy, Severity, audit_text, diff, explain, load_org_policy
from tests.conftest import REPO, SMOLFILES

CASES = [
    ("net = true\n", "FLEET001", 1),
    ('[network]\nallow_hosts = ["com"]\n', "FLEET002", 2),
    ('[network]\nallow_hosts = ["github.io"]\n', "FLEET002", 2),
    ('[network]\nallow_hosts = ["co.uk"]\n', "FLEET002", 2),
    ('[network]\nallow_hosts = ["1.2.3.4"]\n', "FLEET003", 2),
    ('[network]\nallow_cidrs = ["8.0.0.0/8"]\n', "FLEET004", 2),
    ('[network]\nallow_cidrs = ["169.254.169.254/32"]\n', "FLEET005", 2),
    ('[network]\nallow_cidrs = ["127.0.0.0/8"]\n', "FLEET005", 2),
    ('[network]\nallow_cidrs = ["192.168.1.0/24"]\n', "FLEET006", 2),
    # The floor in its IPv6 spellings: IPv4-mapped, NAT64 and 6to4.
    ('[network]\nallow_cidrs = ["::ffff:169.254.169.254/128"]\n', "FLEET005", 2),
    ('[network]\nallow_cidrs = ["64:ff9b::a9fe:a9fe/128"]\n', "FLEET005", 2),
    ('[network]\nallow_cidrs = ["2002:a9fe:a9fe::/48"]\n', "FLEET005", 2),
    ('[network]\nallow_cidrs = ["::ffff:127.0.0.1/128"]\n', "FLEET005", 2),
    (
        '[network]\nallow_hosts = ["pypi.org"]\n[[network.credentials]]\nname = "T"\n'
        'environment_variable = "T"\nallowed_hosts = ["api.evil.example"]\n',
        "FLEET007",
        3,
    ),
    ('[network]\nallow_hosts = ["pypi.org", "pypi.org"]\n', "FLEET009", 2),
    ('[network]\nallow_hosts = ["pypi.org", "files.pypi.org"]\n', "FLEET009", 2),
    ('[network]\nallow_cidrs = ["10.1.0.0/16", "10.1.2.0/24"]\n', "FLEET009", 2),
    ('[network]\nallow_hosts = ["bad host!"]\n', "FLEET010", 2),
    ("cpu = 1\n", "FLEET014", None),
]


@pytest.mark.parametrize(
    ("text", "rule", "line"), CASES, ids=[c[1] + "-" + str(i) for i, c in enumerate(CASES)]
)
def test_each_rule_fires_with_its_line(text: str, rule: str, line: int | None) -> None:
    """Each risky pattern yields its rule, with the file and the line of the key."""
    findings = audit_text('image = "minimal"\n' + text, "x.smolfile")
    hits = [f for f in findings if f.rule == rule]
    assert hits, findings
    assert hits[0].file == "x.smolfile"
    if line is not None:
        assert hits[0].line == line + 1


def test_a_wide_allowlist_split_into_many_entries_is_judged_as_a_whole() -> None:
    """3,500 /16 entries (5.3% of IPv4): each within the per-entry limit, together far over
    it; the finding names the total span."""
    cidrs = ", ".join(f'"{a}.{b}.0.0/16"' for a in range(11, 25) for b in range(250))
    findings = audit_text(f'image = "minimal"\n[network]\nallow_cidrs = [{cidrs}]\n', "w")
    wide = [f for f in findings if f.rule == "FLEET004"]
    assert len(wide) == 1, findings
    assert "3500 allow_cidrs entries together span 229,376,000 IPv4 addresses" in wide[0].message
    assert "5.34% of IPv4" in wide[0].message
    two = audit_text(
        'image = "minimal"\n[network]\nallow_cidrs = ["8.8.0.0/16", "9.9.0.0/16"]\n', "ok"
    )
    assert [f.rule for f in two] == []  # two /16s stay under the total's default (one /12)


def test_a_narrow_public_allowlist_is_clean() -> None:
    """Specific names and a narrow public range produce no findings."""
    text = (
        'image = "minimal"\n[network]\nallow_hosts = ["pypi.org"]\n'
        'allow_cidrs = ["203.0.113.0/28"]\n'
    )
    assert audit_text(text, "ok.smolfile") == []


def test_secrets_in_shared_files() -> None:
    """[secrets] is flagged in files matching the shared globs only."""
    text = 'image = "minimal"\n[secrets]\nT = { from_env = "T" }\n'
    assert [f.rule for f in audit_text(text, "smolfiles/a.smolfile")] == ["FLEET008"]
    assert audit_text(text, "local/a.smolfile") == []


def test_org_policy_forbids_requires_and_limits() -> None:
    """The organisation's file forbids names, requires others and caps the list."""
    org = OrgPolicy(forbid_hosts=["pastebin.com"], require_hosts=["mirror.corp"], max_hosts=1)
    text = 'image = "minimal"\n[network]\nallow_hosts = ["pastebin.com", "pypi.org"]\n'
    rules = {f.rule for f in audit_text(text, "a.smolfile", org)}
    assert {"FLEET011", "FLEET012", "FLEET013"} <= rules
    assert OrgPolicy(allow_open_egress=True) and not [
        f
        for f in audit_text(
            'image = "minimal"\nnet = true\n', "a", OrgPolicy(allow_open_egress=True)
        )
    ]


def test_example_org_policy_loads() -> None:
    """The example org policy under smolfiles/ is valid."""
    org = load_org_policy(str(SMOLFILES / "org-policy.example.toml"))
    assert "pastebin.com" in org.forbid_hosts and org.max_hosts == 10


def test_explain_and_diff() -> None:
    """explain states what is reachable and the floor; diff lists what a change adds and removes."""
    worker = (SMOLFILES / "eval-worker.smolfile").read_text()
    minimal = (SMOLFILES / "minimal.smolfile").read_text()
    words = "\n".join(explain(worker, "w"))
    assert "pypi.org and all of its subdomains" in words and "169.254.169.254" in words
    assert "Networking is off" in "\n".join(explain(minimal, "m"))
    changes = diff(minimal, "m", worker, "w")
    assert "  + host pypi.org" in changes and not any(c.startswith("  - ") for c in changes)
    assert "  - host pypi.org" in diff(worker, "w", minimal, "m")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleet.cli.main", "policy", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_cli_exit_status_follows_fail_on(tmp_path: Path) -> None:
    """audit exits 1 when a finding is at or above --fail-on, else 0; json and sarif parse."""
    risky = tmp_path / "risky.smolfile"
    risky.write_text('image = "minimal"\n[network]\nallow_cidrs = ["192.168.0.0/24"]\n')
    assert cli("audit", str(risky)).returncode == 0  # medium < high
    assert cli("audit", str(risky), "--fail-on", "medium").returncode == 1
    as_json = json.loads(cli("audit", str(risky), "--format", "json").stdout)
    assert as_json[0]["rule"] == "FLEET006" and as_json[0]["severity"] == "medium"
    sarif = json.loads(cli("audit", str(risky), "--format", "sarif").stdout)
    assert (
        sarif["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]["startLine"]
        == 3
    )


def test_shipped_smolfiles_are_clean_at_high() -> None:
    """Every example Smolfile passes the audit at --fail-on high against the example policy."""
    files = sorted(str(p) for p in SMOLFILES.glob("*.smolfile"))
    out = cli("audit", *files, "--org-policy", str(SMOLFILES / "org-policy.example.toml"))
    assert out.returncode == 0, out.stdout
    assert Severity.HIGH > Severity.MEDIUM > Severity.LOW
