"""Which OpenAI-compatible upstreams the gateway forwards to, with the keys it holds for them.

An upstream is registered as `NAME=URL` (`fleet gateway --upstream`, repeatable) or in a TOML
file (`--upstreams FILE`); its models are then served here as `NAME/MODEL` (`MODEL` is what
the upstream itself calls it). Its key comes from an environment variable or a file,
`--upstream-key NAME=ENV_VAR` or `NAME=@FILE`, and never from the command line itself: a
command line is visible to every process on the host (`/proc/PID/cmdline`), and a key is
exactly what the gateway exists to keep out of reach. Keys are held as `SecretStr`, so that a
repr or a log line shows stars, and `scrub` removes any echo of one from text that leaves the
gateway.

The TOML file:

    connect_timeout_s = 5.0     # optional: these are the defaults
    read_timeout_s = 120.0      # between two chunks of an answer
    max_connections = 64        # open to each upstream at once (kept alive between requests)

    [upstreams.vllm]
    url = "http://127.0.0.1:8000/v1"
    key_env = "VLLM_API_KEY"    # or key_file = "vllm.key" (relative to this file); or neither

    [fallbacks]
    "vllm/llama-3-8b" = ["hosted/llama-3-8b"]

A fallback chain (`--fallback MODEL=A,B` or `[fallbacks]`) is tried in order when the model's
upstream refuses the connection or fails before the answer's first token; only the requested
model's own chain is followed (chains do not chain).
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from fleet.core.errors import InvalidArgument

NAME_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
MAX_KEY_BYTES = 8192
MAX_CHAIN = 8
REDACTED = "[redacted]"


@dataclass(frozen=True)
class Upstream:
    """One OpenAI-compatible server: `url` is its base, as OPENAI_BASE_URL would be (the API's
    paths, `/chat/completions`, are appended to it)."""

    name: str
    url: str
    key: SecretStr | None = None

    def __repr__(self) -> str:  # (the URL may name an internal host; the key never shows)
        return f"Upstream({self.name!r}, key={'set' if self.key else 'none'})"


@dataclass(frozen=True)
class UpstreamConfig:
    upstreams: Mapping[str, Upstream] = field(default_factory=dict)
    fallbacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Requested model (`NAME/MODEL`) -> the models tried after it, in order."""
    connect_timeout_s: float = 5.0
    """Bounds the connect, and the wait for a free connection of the upstream's pool."""
    read_timeout_s: float = 120.0
    """Bounds the silence between two chunks of an answer."""
    max_connections: int = 64
    """Connections open to each upstream at once: its pool, each kept alive for the next
    request (a burst of streams reuses the last burst's)."""

    def keys(self) -> list[str]:
        """Every key held, for `scrub`."""
        return [u.key.get_secret_value() for u in self.upstreams.values() if u.key is not None]


class _UpstreamEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    key_env: str = ""
    key_file: str = ""


class _UpstreamsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    upstreams: dict[str, _UpstreamEntry] = Field(default_factory=dict)
    fallbacks: dict[str, list[str]] = Field(default_factory=dict)
    connect_timeout_s: float = Field(5.0, gt=0, le=600)
    read_timeout_s: float = Field(120.0, gt=0, le=3600)
    max_connections: int = Field(64, ge=1, le=4096)


def scrub(text: str, keys: Iterable[str]) -> str:
    """`text` with every occurrence of any of `keys` replaced by REDACTED: what an upstream
    says (an error that quotes the request's headers, say) is passed on only scrubbed."""
    for key in keys:
        if key and key in text:
            text = text.replace(key, REDACTED)
    return text


def check_name(name: str, where: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidArgument(f"{where}: upstream name {name[:80]!r} is not {NAME_RULE} characters")
    return name


def check_url(url: str, where: str) -> str:
    """An http(s) base URL with a host and no credentials in it (a key in a URL would be a key
    on the command line, and in every log that prints URLs)."""
    try:
        parts = urlsplit(url)
        port = parts.port  # (raises for a port that is not a number)
    except ValueError:
        raise InvalidArgument(f"{where}: not a URL") from None
    if parts.username is not None or parts.password is not None:
        raise InvalidArgument(
            f"{where}: the URL carries credentials (user:password@); give the upstream's key "
            "with --upstream-key NAME=ENV_VAR or NAME=@FILE instead"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(
            f"{where}: {url[:200]!r} is not an http:// or https:// URL with a host (the API's "
            "base, as OPENAI_BASE_URL: http://127.0.0.1:8000/v1)"
        )
    if parts.query or parts.fragment:
        raise InvalidArgument(f"{where}: the URL has a query or fragment; give the API's base")
    del port
    return url.rstrip("/")


def check_model(model: str, where: str, upstreams: Mapping[str, Upstream]) -> str:
    """`NAME/MODEL` of a registered upstream."""
    name, slash, rest = model.partition("/")
    if not slash or not _MODEL.fullmatch(rest) or not _NAME.fullmatch(name):
        raise InvalidArgument(f"{where}: {model[:120]!r} is not UPSTREAM/MODEL")
    if name not in upstreams:
        raise InvalidArgument(
            f"{where}: {model[:120]!r} names no upstream registered here (registered: "
            f"{', '.join(sorted(upstreams)) or 'none'})"
        )
    return model


def parse_pair(text: str, flag: str, shape: str) -> tuple[str, str]:
    """`NAME=VALUE` of a flag, or a refusal naming the flag (never quoting VALUE, which may be
    a key given where it must not be)."""
    name, eq, value = text.partition("=")
    if not eq or not name.strip() or not value.strip():
        raise InvalidArgument(f"{flag} {name[:64]!r}…: expected {shape}")
    return name.strip(), value.strip()


def read_key(source: str, where: str, base: Path | None = None) -> SecretStr:
    """The key `source` names: `@FILE` (its content, one line) or `ENV_VAR` (its value).
    Refusals name the variable or the file, never what they hold."""
    if source.startswith("@"):
        path = Path(source[1:])
        if base is not None and not path.is_absolute():
            path = base / path
        try:
            with path.open("rb") as f:
                raw = f.read(MAX_KEY_BYTES + 1)
        except OSError as exc:
            raise InvalidArgument(
                f"{where}: cannot read the key file {str(path)!r}: "
                f"{exc.strerror or type(exc).__name__}"
            ) from None
        if len(raw) > MAX_KEY_BYTES:
            raise InvalidArgument(
                f"{where}: the key file {str(path)!r} is over {MAX_KEY_BYTES} bytes"
            )
        try:
            key = raw.decode().strip()
        except UnicodeDecodeError:
            raise InvalidArgument(f"{where}: the key file {str(path)!r} is not UTF-8") from None
        origin = f"the key file {str(path)!r}"
    else:
        if not _ENV_NAME.fullmatch(source):
            raise InvalidArgument(
                f"{where}: expected ENV_VAR (the environment variable that holds the key) or "
                "@FILE; the key itself is never taken on the command line"
            )
        key = os.environ.get(source, "").strip()
        origin = f"${source}"
    if not key:
        raise InvalidArgument(f"{where}: {origin} is empty or unset")
    if any(c.isspace() or not c.isprintable() for c in key):
        raise InvalidArgument(
            f"{where}: {origin} holds whitespace or control characters "
            "(one key on one line is expected)"
        )
    return SecretStr(key)


def load_upstreams(
    upstream: Sequence[str] = (),
    upstream_key: Sequence[str] = (),
    fallback: Sequence[str] = (),
    upstreams_file: Path | None = None,
) -> UpstreamConfig:
    """The upstreams of `fleet gateway`'s flags and TOML file, keys read, everything checked:
    a bad entry is refused naming its flag or the file and field."""
    entries: dict[str, tuple[str, str]] = {}  # name -> (url, key source)
    key_base: dict[str, Path] = {}
    fallbacks: dict[str, list[str]] = {}
    limits: dict[str, float | int] = {}
    if upstreams_file is not None:
        where = f"--upstreams {upstreams_file}"
        try:
            data = tomllib.loads(upstreams_file.read_text())
            parsed = _UpstreamsFile.model_validate(data)
        except OSError as exc:
            raise InvalidArgument(f"{where}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"{where}: not TOML: {exc}") from None
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            loc = ".".join(str(p) for p in first["loc"])
            hint = (
                " (keys are never written in this file: key_env or key_file)"
                if first["type"] == "extra_forbidden" and "key" in loc
                else ""
            )
            raise InvalidArgument(f"{where}: {loc}: {first['msg']}{hint}") from None
        limits = parsed.model_dump(
            include={"connect_timeout_s", "read_timeout_s", "max_connections"}
        )
        for name, entry in parsed.upstreams.items():
            at = f"{where}: upstreams.{name}"
            check_name(name, at)
            if entry.key_env and entry.key_file:
                raise InvalidArgument(f"{at}: key_env and key_file both given; give one")
            source = entry.key_env or (f"@{entry.key_file}" if entry.key_file else "")
            entries[name] = (check_url(entry.url, f"{at}.url"), source)
            key_base[name] = upstreams_file.parent
        fallbacks = {m: list(chain) for m, chain in parsed.fallbacks.items()}
    for text in upstream:
        name, url = parse_pair(text, "--upstream", "NAME=URL")
        check_name(name, "--upstream")
        if name in entries:
            raise InvalidArgument(f"--upstream {name}: registered twice")
        entries[name] = (check_url(url, f"--upstream {name}"), "")
    for text in upstream_key:
        name, source = parse_pair(text, "--upstream-key", "NAME=ENV_VAR or NAME=@FILE")
        if name not in entries:
            raise InvalidArgument(
                f"--upstream-key {name[:64]!r}: no upstream of that name "
                "(register it with --upstream NAME=URL)"
            )
        if entries[name][1]:
            raise InvalidArgument(f"--upstream-key {name}: the upstream's key is given twice")
        entries[name] = (entries[name][0], source)
        key_base.pop(name, None)  # (a flag's @FILE is relative to the working directory)
    ups = {
        name: Upstream(
            name,
            url,
            read_key(source, f"upstream {name}'s key", key_base.get(name)) if source else None,
        )
        for name, (url, source) in entries.items()
    }
    for text in fallback:
        model, listed = parse_pair(text, "--fallback", "MODEL=UPSTREAM/MODEL[,UPSTREAM/MODEL...]")
        if model in fallbacks:
            raise InvalidArgument(f"--fallback {model[:120]}: its chain is given twice")
        fallbacks[model] = [m.strip() for m in listed.split(",")]
    checked: dict[str, tuple[str, ...]] = {}
    for model, chain in fallbacks.items():
        where = f"fallback of {model[:120]}"
        check_model(model, where, ups)
        if not chain or len(chain) > MAX_CHAIN:
            raise InvalidArgument(f"{where}: 1 to {MAX_CHAIN} models, got {len(chain)}")
        for m in chain:
            check_model(m, where, ups)
        if model in chain or len(set(chain)) != len(chain):
            raise InvalidArgument(f"{where}: a model is named twice in the chain")
        checked[model] = tuple(chain)
    return UpstreamConfig(
        ups,
        checked,
        connect_timeout_s=float(limits.get("connect_timeout_s", 5.0)),
        read_timeout_s=float(limits.get("read_timeout_s", 120.0)),
        max_connections=int(limits.get("max_connections", 64)),
    )
