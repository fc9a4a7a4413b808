"""The Smolfile: smolvm's TOML machine description, parsed into a frozen model.

Fleet covers every upstream key and adds none, so a file fleet accepts stays valid for
`smolvm machine run -s`. Unknown keys, wrong types and bad values are refused with the file,
line and key in the message.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import re
import tomllib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fleet.core.errors import InvalidArgument

MAX_SMOLFILE_BYTES = 64 * 1024
MAX_DISK_GIB = 4096
"""`overlay` and `storage` above this many GiB are refused as mistakes."""
MAX_IMAGE_CHARS = 512
DEFAULT_CPUS = 4
DEFAULT_MEMORY_MIB = 8192

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_NAME_RULE = "a letter or _, then letters, digits and _ (POSIX)"
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_DURATION = re.compile(r"^\d+(ms|s|m|h)$")
_PORT = re.compile(r"^\d{1,5}:\d{1,5}$")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def is_env_name(name: str) -> bool:
    """Whether `name` is a portable environment variable name (`[A-Za-z_][A-Za-z0-9_]*`):
    shells and programs cannot read others, and a newline or `=` in one would let it stand
    for other variables."""
    return _ENV_KEY.fullmatch(name) is not None


def _check_env(items: list[str]) -> list[str]:
    for item in items:
        key, sep, _ = item.partition("=")
        if not sep:
            raise ValueError(f"{item[:100]!r} is not KEY=VALUE")
        if not is_env_name(key):
            raise ValueError(
                f"{item[:100]!r}: {key[:100]!r} is not a variable name ({ENV_NAME_RULE})"
            )
    return items


def _check_ports(items: list[str]) -> list[str]:
    for item in items:
        if not _PORT.match(item) or not all(0 < int(p) < 65536 for p in item.split(":")):
            raise ValueError(f"{item!r} is not a port mapping HOST:GUEST with ports 1-65535")
    return items


def _check_volumes(items: list[str]) -> list[str]:
    for item in items:
        parts = item.split(":")
        if len(parts) not in (2, 3) or not all(parts[:2]) or parts[2:] not in ([], ["ro"]):
            raise ValueError(f"{item!r} is not a volume SOURCE:TARGET or SOURCE:TARGET:ro")
        if not parts[1].startswith("/"):
            raise ValueError(f"volume target {parts[1]!r} must be an absolute path")
    return items


_IMAGE = re.compile(r"[A-Za-z0-9./_][A-Za-z0-9._:/@+-]*")
_IMAGE_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_STORE_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


def check_image_field(value: str) -> str:
    """A Smolfile `image`: a store name, a registry reference, an archive path or a digest, in
    the characters those use (no spaces, no control characters, no NUL)."""
    if not value or len(value) > MAX_IMAGE_CHARS or not _IMAGE.fullmatch(value):
        raise ValueError(
            f"{value[:100]!r} is not an image name, reference, archive path or digest "
            f"(letters, digits and ._:/@+- only, at most {MAX_IMAGE_CHARS} characters)"
        )
    if value.startswith("sha256:") and not _IMAGE_DIGEST.fullmatch(value):
        raise ValueError(f"{value[:100]!r} is not a digest (sha256: and 64 lower-case hex digits)")
    return value


def check_store_name(name: str) -> str:
    """An image store name: lower-case letters, digits and ._- (it names files in the store)."""
    if not _STORE_NAME.match(name) or ".." in name:
        raise InvalidArgument(
            f"{name[:100]!r} is not an image name (lower-case letters, digits and ._-, "
            "at most 128 characters, not starting with . or -)"
        )
    return name


def check_host_name(name: str) -> str:
    """A DNS name as an allowlist entry: labels of letters, digits and hyphens."""
    candidate = name.removeprefix("*.").rstrip(".")
    if not candidate or len(candidate) > 253:
        raise ValueError(f"{name!r} is not a host name")
    if not all(_HOST_LABEL.match(label) for label in candidate.split(".")):
        raise ValueError(f"{name!r} is not a host name")
    return name


def allow_cidr(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    """An `allow_cidrs` entry as fleet reads it everywhere: an IPv4-mapped IPv6 range
    (`::ffff:10.0.0.0/104`) is the IPv4 range it reaches (`10.0.0.0/8`), so that the entry
    means the same to the audit, the firewall and the DNS forwarder. Host bits must be zero.
    Raises ValueError."""
    net = ipaddress.ip_network(text, strict=True)
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96:
        mapped = net.network_address.ipv4_mapped
        if mapped is not None:
            return ipaddress.IPv4Network((int(mapped), net.prefixlen - 96))
    return net


class Credential(_Section):
    """A secret the guest sees only as a placeholder, substituted for the listed hosts."""

    name: str
    environment_variable: str
    allowed_hosts: list[str] = Field(default_factory=list)

    @field_validator("environment_variable")
    @classmethod
    def _env_name(cls, value: str) -> str:
        if not _ENV_KEY.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid environment variable name")
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        return [check_host_name(v) for v in value]


class Network(_Section):
    """Egress allowlist: names (and their subdomains) and CIDR ranges."""

    allow_hosts: list[str] = Field(default_factory=list)
    allow_cidrs: list[str] = Field(default_factory=list)
    credentials: list[Credential] = Field(default_factory=list)

    @field_validator("allow_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        return [check_host_name(v) for v in value]

    @field_validator("allow_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str]) -> list[str]:
        out = []
        for item in value:
            try:
                out.append(str(allow_cidr(item)))
            except ValueError as exc:
                raise ValueError(f"{item!r} is not a CIDR range: {exc}") from None
        return out


class Dev(_Section):
    """Local development overrides (`smol up`); never used by the fleet's own runs."""

    volumes: list[str] = Field(default_factory=list)
    ports: list[str] = Field(default_factory=list)
    env: list[str] = Field(default_factory=list)
    init: list[str] = Field(default_factory=list)
    workdir: str | None = None
    user: str | None = None

    _env = field_validator("env")(classmethod(lambda cls, v: _check_env(v)))
    _ports = field_validator("ports")(classmethod(lambda cls, v: _check_ports(v)))
    _volumes = field_validator("volumes")(classmethod(lambda cls, v: _check_volumes(v)))


class SecretRef(_Section):
    from_env: str

    @field_validator("from_env")
    @classmethod
    def _env_name(cls, value: str) -> str:
        if not _ENV_KEY.fullmatch(value):
            raise ValueError(f"{value!r} is not a valid environment variable name")
        return value


class Artifact(_Section):
    """Overrides for a packed `.smolmachine`."""

    cpus: Annotated[int, Field(ge=1, le=255)] | None = None
    memory: Annotated[int, Field(ge=64, le=2**32 - 1)] | None = None
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    oci_platform: str | None = None


class Health(_Section):
    exec: list[str] = Field(default_factory=list)
    interval: str | None = None
    timeout: str | None = None
    retries: Annotated[int, Field(ge=0)] | None = None

    @field_validator("interval", "timeout")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None and not _DURATION.match(value):
            raise ValueError(f"{value!r} is not a duration like 500ms, 10s, 5m or 1h")
        return value


class Restart(_Section):
    policy: Literal["never", "always", "on-failure", "unless-stopped"] | None = None
    max_retries: Annotated[int, Field(ge=0)] | None = None


class Branch(_Section):
    """Copy-on-write branching from a warm parent."""

    enabled: bool | None = None
    pool_size: Annotated[int, Field(ge=1, le=1024)] | None = None
    cuda_vram_limit_mib: Annotated[int, Field(ge=1)] | None = None


class Smolfile(_Section):
    """One machine description; field names are upstream's keys."""

    image: str | None = None
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    env: list[str] = Field(default_factory=list)
    workdir: str | None = None
    user: str | None = None
    cpus: Annotated[int, Field(ge=1, le=255)] | None = None
    memory: Annotated[int, Field(ge=64, le=2**32 - 1)] | None = None
    storage: Annotated[int, Field(ge=1, le=MAX_DISK_GIB)] | None = None
    overlay: Annotated[int, Field(ge=1, le=MAX_DISK_GIB)] | None = None
    net: bool | None = None
    gpu: bool | None = None
    gpu_vram: Annotated[int, Field(ge=1, le=1 << 24)] | None = None
    cuda: bool | None = None
    init: list[str] = Field(default_factory=list)
    network: Network | None = None
    dev: Dev | None = None
    secrets: dict[str, SecretRef] = Field(default_factory=dict)
    artifact: Artifact | None = None
    health: Health | None = None
    restart: Restart | None = None
    branch: Branch | None = None

    _env = field_validator("env")(classmethod(lambda cls, v: _check_env(v)))

    @field_validator("image")
    @classmethod
    def _image(cls, value: str | None) -> str | None:
        return None if value is None else check_image_field(value)

    @field_validator("workdir")
    @classmethod
    def _abs(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"{value!r} must be an absolute path")
        return value

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, value: dict[str, SecretRef]) -> dict[str, SecretRef]:
        for name in value:
            if not _ENV_KEY.fullmatch(name):
                raise ValueError(f"secret name {name!r} is not a valid environment variable name")
        return value

    @property
    def cpus_effective(self) -> int:
        return self.cpus if self.cpus is not None else DEFAULT_CPUS

    @property
    def memory_mib_effective(self) -> int:
        return self.memory if self.memory is not None else DEFAULT_MEMORY_MIB

    @property
    def needs_cuda(self) -> bool:
        return bool(self.cuda)

    @property
    def egress_requested(self) -> bool:
        """Whether the file asks for any network at all (open or allowlisted)."""
        net = self.network
        return bool(self.net) or bool(net and (net.allow_hosts or net.allow_cidrs))

    @property
    def env_map(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.env)


class ParsedSmolfile(BaseModel):
    """A Smolfile with where it came from and the digest of its exact text."""

    model_config = ConfigDict(frozen=True)

    name: str
    text: str
    digest: str
    spec: Smolfile


def digest_text(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*("[^"]*"|'[^']*'|[A-Za-z0-9_.-]+)\s*=""")
_INLINE_KEY = re.compile(r"""([A-Za-z0-9_-]+)\s*=""")


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Maps each table and key path to the first line (1-based) that defines it."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header:
            table = tuple(part.strip().strip("\"'") for part in header.group(2).split("."))
            lines.setdefault(table, number)
            continue
        key = _KEY.match(line)
        if key:
            path = table + tuple(p.strip("\"'") for p in key.group(1).split("."))
            lines.setdefault(path, number)
            rest = line[key.end() :]
            if rest.lstrip().startswith("{"):
                for inner in _INLINE_KEY.findall(rest):
                    lines.setdefault((*path, inner), number)
    return lines


def _line_for(loc: tuple[str | int, ...], lines: dict[tuple[str, ...], int]) -> int | None:
    path = tuple(str(p) for p in loc if not isinstance(p, int))
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


def _nul_key(data: Any) -> tuple[str | int, ...] | None:
    """The path of the first key or string value holding a NUL (None: none does)."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if "\0" in value:
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if "\0" in key:
                    return (*path, key)
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in enumerate(value))
    return None


@functools.lru_cache(maxsize=128)
def parse_smolfile(text: str, name: str = "<smolfile>") -> ParsedSmolfile:
    """Parses and validates Smolfile text; raises InvalidArgument naming file, line and key.

    The result is frozen, so one parse serves every caller of the same text and name (each
    submission and each attempt of a fleet running one Smolfile asks again; a refusal is not
    kept: it is parsed again, and refused again, each time)."""
    if len(text.encode()) > MAX_SMOLFILE_BYTES:
        raise InvalidArgument(
            f"{name}: Smolfile is {len(text.encode())} bytes, over the {MAX_SMOLFILE_BYTES} limit"
        )
    try:
        data: dict[str, Any] = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{name}: malformed TOML: {exc}") from exc
    except RecursionError:
        raise InvalidArgument(f"{name}: malformed TOML: nested too deeply") from None
    nul = _nul_key(data)
    if nul is not None:
        line = _line_for(nul, key_lines(text))
        where = f"{name}:{line}" if line is not None else name
        key = ".".join(str(p) for p in nul)
        raise InvalidArgument(f"{where}: key {key!r}: a NUL character is not allowed")
    try:
        spec = Smolfile.model_validate(data)
    except RecursionError:
        raise InvalidArgument(f"{name}: nested too deeply") from None
    except ValidationError as exc:
        lines = key_lines(text)
        problems = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            key = ".".join(str(p) for p in loc) or "<top>"
            line = _line_for(loc, lines)
            where = f"{name}:{line}" if line is not None else name
            if err["type"] == "extra_forbidden":
                what = f"unknown key {key!r} (not a Smolfile key)"
            else:
                what = f"key {key!r}: {err['msg']}"
            problems.append(f"{where}: {what}")
        raise InvalidArgument("; ".join(problems)) from exc
    return ParsedSmolfile(name=name, text=text, digest=digest_text(text), spec=spec)


def load_smolfile(path: str) -> ParsedSmolfile:
    """Reads and parses a Smolfile from disk."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: cannot read Smolfile: {exc}") from exc
    return parse_smolfile(text, name=path)
