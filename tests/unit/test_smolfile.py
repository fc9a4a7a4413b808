"""The Smolfile model: every example parses, every upstream key is covered, bad input is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.core.errors import InvalidArgument
from fleet.core.smolfile import MAX_SMOLFILE_BYTES, load_smolfile, parse_smolfile
from tests.conftest import SMOLFILES

EVERY_KEY = """
image = "minimal"
entrypoint = ["python3"]
cmd = ["-c", "print(1)"]
env = ["A=1", "B=two=2"]
workdir = "/root"
user = "root"
cpus = 2
memory = 1024
storage = 10
overlay = 2
net = false
gpu = false
gpu_vram = 512
cuda = false
init = ["echo hi"]

[network]
allow_hosts = ["pypi.org", "*.example.com"]
allow_cidrs = ["10.0.0.0/8", "2001:db8::/32"]

[[network.credentials]]
name = "TOKEN"
environment_variable = "API_TOKEN"
allowed_hosts = ["api.example.com"]

[dev]
volumes = ["./src:/app", "./data:/data:ro"]
ports = ["8080:80"]
env = ["DEBUG=1"]
init = ["make dev"]
workdir = "/app"
user = "dev"

[secrets]
TOKEN = { from_env = "HOST_TOKEN" }

[artifact]
cpus = 1
memory = 512
entrypoint = ["/bin/app"]
cmd = ["serve"]
oci_platform = "linux/amd64"

[health]
exec = ["true"]
interval = "10s"
timeout = "500ms"
retries = 3

[restart]
policy = "never"
max_retries = 0

[branch]
enabled = true
pool_size = 4
cuda_vram_limit_mib = 2048
"""


def example_files() -> list[Path]:
    return sorted(SMOLFILES.glob("*.smolfile"))


def test_there_are_examples_of_each_kind() -> None:
    """smolfiles/ holds a CPU worker with an allowlist, a GPU warm parent and a no-network one."""
    specs = [load_smolfile(str(p)).spec for p in example_files()]
    assert any(s.network and s.network.allow_hosts and not s.cuda for s in specs)
    assert any(s.cuda and s.branch and s.branch.enabled for s in specs)
    assert any(not s.egress_requested for s in specs)


@pytest.mark.parametrize("path", example_files(), ids=lambda p: p.name)
def test_every_example_parses(path: Path) -> None:
    """Each example Smolfile is valid and names an image."""
    parsed = load_smolfile(str(path))
    assert parsed.spec.image
    assert parsed.digest.startswith("sha256:")


def test_every_upstream_key_is_accepted() -> None:
    """A file using every key SMOLVM.md lists parses, values intact."""
    spec = parse_smolfile(EVERY_KEY, "all.smolfile").spec
    assert spec.env_map == {"A": "1", "B": "two=2"}
    assert spec.network is not None and spec.network.credentials[0].environment_variable == (
        "API_TOKEN"
    )
    assert spec.secrets["TOKEN"].from_env == "HOST_TOKEN"
    assert spec.branch is not None and spec.branch.cuda_vram_limit_mib == 2048
    assert spec.health is not None and spec.health.timeout == "500ms"
    assert spec.artifact is not None and spec.artifact.oci_platform == "linux/amd64"


def test_model_is_frozen() -> None:
    """Parsed Smolfiles cannot be changed in place."""
    spec = parse_smolfile('image = "minimal"\n').spec
    with pytest.raises(ValueError):
        spec.cpus = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('image = "minimal"\ncpus = [\n', "f.smolfile: malformed TOML"),
        ('image = "minimal"\ncpus = 2 2\n', "line 2, column"),
        ('image = "minimal"\ncpu = 2\n', "f.smolfile:2: unknown key 'cpu'"),
        (
            'image = "minimal"\n\n[network]\nallow_host = ["a.b"]\n',
            "f.smolfile:4: unknown key 'network.allow_host'",
        ),
        (
            'image = "minimal"\ncpus = "2"\n',
            "f.smolfile:2: key 'cpus': Input should be a valid integer",
        ),
        ('image = "minimal"\nnet = "yes"\n', "f.smolfile:2: key 'net'"),
        ('image = "minimal"\ncpus = 0\n', "f.smolfile:2: key 'cpus'"),
        ('image = "minimal"\nenv = ["NOEQUALS"]\n', "f.smolfile:2: key 'env'"),
        ('image = "minimal"\nworkdir = "relative"\n', "must be an absolute path"),
        ('[network]\nallow_cidrs = ["10.0.0.1/8"]\n', "f.smolfile:2: key 'network.allow_cidrs'"),
        ('[network]\nallow_hosts = ["bad host"]\n', "is not a host name"),
        ('[health]\ninterval = "soon"\n', "f.smolfile:2: key 'health.interval'"),
        ('[restart]\npolicy = "sometimes"\n', "f.smolfile:2: key 'restart.policy'"),
        ("[branch]\nenabled = 1\n", "f.smolfile:2: key 'branch.enabled'"),
        ("[secrets]\nK = { from_env = 3 }\n", "f.smolfile:2: key 'secrets.K.from_env'"),
        ('[dev]\nports = ["80"]\n', "f.smolfile:2: key 'dev.ports'"),
    ],
)
def test_bad_smolfiles_are_refused_with_file_line_and_key(text: str, expected: str) -> None:
    """Each malformed file is refused with a message naming the file, line and key."""
    with pytest.raises(InvalidArgument) as info:
        parse_smolfile(text, "f.smolfile")
    assert expected in info.value.message


def test_oversized_smolfile_is_refused() -> None:
    """A Smolfile over the size limit is refused before parsing."""
    with pytest.raises(InvalidArgument, match="over the"):
        parse_smolfile("# " + "x" * MAX_SMOLFILE_BYTES)


def test_unreadable_file_is_refused(tmp_path: Path) -> None:
    """A missing file is refused with its path."""
    with pytest.raises(InvalidArgument, match="cannot read Smolfile"):
        load_smolfile(str(tmp_path / "nope.smolfile"))


def test_digest_is_of_the_exact_text() -> None:
    """Two texts with the same meaning but different bytes have different digests."""
    a = parse_smolfile('image = "minimal"\n')
    b = parse_smolfile('image = "minimal"  \n')
    assert a.spec == b.spec
    assert a.digest != b.digest
