"""Which registries fleet reaches, how it names them and whose credentials go where.

A registry reference (`Reference`), whether a Smolfile's `image` is an archive or a registry's
image, the operator's `FLEET_REGISTRY_*` settings, the credentials read from them, and the
`RegistryPolicy` every registry request is checked against. Nothing here opens a connection:
the client (`fleet.image.registry_client`) and the image operations (`fleet.image.oci`) stand
on it, and the server checks a tenant's reference with it before anything is fetched.
"""

from __future__ import annotations

import argparse
import re
import ssl
from collections.abc import Iterable
from dataclasses import dataclass

from fleet.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from fleet.core.manifest import is_digest
from fleet.settings import RegistrySettings, SettingsError


@dataclass(frozen=True)
class Reference:
    """`[https://]host[:port]/repo[:tag|@sha256:…]`."""

    base: str
    """`https://host:port` (http:// only when written so)."""
    repository: str
    tag: str = ""
    digest: str = ""

    @classmethod
    def parse(cls, text: str) -> Reference:
        scheme = "https://"
        rest = text
        for prefix in ("https://", "http://"):
            if text.startswith(prefix):
                scheme, rest = prefix, text.removeprefix(prefix)
        host, sep, path = rest.partition("/")
        if not sep or not host or not path:
            raise InvalidArgument(f"registry reference {text!r}: expected HOST[:PORT]/REPO[:TAG]")
        name, colon, port = host.rpartition(":") if not host.endswith("]") else (host, "", "")
        if colon and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536 and name):
            raise InvalidArgument(
                f"registry reference {text[:200]!r}: {host[:100]!r} is not HOST[:PORT] "
                "(a port is 1-65535)"
            )
        digest = tag = ""
        if "@" in path:
            path, _, digest = path.partition("@")
            if not is_digest(digest):
                raise InvalidArgument(f"registry reference {text!r}: {digest!r} is not a digest")
        elif ":" in path.rsplit("/", 1)[-1]:
            path, _, tag = path.rpartition(":")
        if not path or any(not part for part in path.split("/")):
            raise InvalidArgument(f"registry reference {text!r}: bad repository {path!r}")
        return cls(scheme + host.lower(), path, tag, digest)

    @property
    def scheme(self) -> str:
        return self.base.partition("://")[0]

    @property
    def netloc(self) -> str:
        """`host[:port]`, lower case (how policies name registries)."""
        return self.base.partition("://")[2].lower()

    def with_tag(self, tag: str) -> Reference:
        return Reference(self.base, self.repository, tag, "")

    def __str__(self) -> str:
        suffix = f"@{self.digest}" if self.digest else (f":{self.tag}" if self.tag else "")
        return f"{self.base}/{self.repository}{suffix}"


ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def looks_like_archive(text: str) -> bool:
    """A Smolfile `image` that is an archive path (a docker-save archive or an OCI layout)."""
    return text.startswith(("/", "./", "../")) or text.endswith(ARCHIVE_SUFFIXES)


def looks_like_reference(text: str) -> bool:
    """A Smolfile `image` that names a registry: it has a host part (a dot, a port or
    localhost) before its first slash."""
    if looks_like_archive(text):
        return False
    head = text.removeprefix("https://").removeprefix("http://").split("/", 1)
    if len(head) < 2:
        return False
    host = head[0]
    return "." in host or ":" in host or host == "localhost"


def tls_context(ca_pem: bytes | None) -> ssl.SSLContext:
    """The system's roots, and the fleet CA's where given (a registry on the fleet's own
    certificate)."""
    context = ssl.create_default_context()
    if ca_pem:
        context.load_verify_locations(cadata=ca_pem.decode())
    return context


SCOPED_AUTH = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:\d+)?=([^:\s]*):(\S*)$")
"""One `HOST[:PORT]=user:password` entry of `$FLEET_REGISTRY_AUTH`."""


def registry_settings() -> RegistrySettings:
    """`FLEET_REGISTRY_*`, read afresh (a bad value is refused naming its variable)."""
    try:
        return RegistrySettings.from_args(argparse.Namespace())
    except SettingsError as exc:
        raise FailedPrecondition(f"registry settings: {exc}") from None


def _entries(text: str) -> tuple[str, ...]:
    return tuple(e.lower() for e in re.split(r"[\s,]+", text.strip()) if e)


@dataclass(frozen=True)
class Credentials:
    username: str = ""
    password: str = ""
    scoped: tuple[tuple[str, str, str], ...] = ()
    """(HOST[:PORT], user, password): credentials for that registry and no other."""

    @classmethod
    def from_env(cls) -> Credentials:
        """`$FLEET_REGISTRY_AUTH`, else anonymous."""
        return cls.parse(registry_settings().auth)

    @classmethod
    def parse(cls, text: str) -> Credentials:
        """`user:password` (for the registries this process is configured with), or
        `HOST[:PORT]=user:password` entries separated by spaces (each for its registry only).
        A malformed entry is refused by its place, never echoed (it holds a password)."""
        parts = text.split()
        if not parts or not SCOPED_AUTH.match(parts[0]):
            user, _, password = text.strip().partition(":")
            return cls(user, password)
        scoped = []
        for index, part in enumerate(parts, 1):
            match = SCOPED_AUTH.match(part)
            if match is None:
                raise FailedPrecondition(
                    f"$FLEET_REGISTRY_AUTH: entry {index} is not HOST[:PORT]=user:password"
                )
            scoped.append(((match[1] + (match[2] or "")).lower(), match[3], match[4]))
        return cls(scoped=tuple(scoped))

    def for_registry(self, netloc: str, *, configured: bool) -> Credentials | None:
        """What to send to the registry at `netloc`: its own entry, else the unscoped
        credentials where it is a registry this process is configured with (None:
        anonymous)."""
        for host, user, password in self.scoped:
            if host == netloc.lower():
                return Credentials(user, password)
        if configured and self.username:
            return Credentials(self.username, self.password)
        return None


@dataclass(frozen=True)
class RegistryPolicy:
    """Where this process may fetch from, over what, and where its credentials go.

    A Smolfile's `image` is the tenant's to write, and the server and hosts fetch it with the
    fleet's own credentials: so a tenant may name only the operator's registries, plain HTTP
    and other hosts (redirects included) are reached only where the operator listed them, and
    what a registry sends is bounded in size and time."""

    configured: tuple[Reference, ...] = ()
    """The operator's registries (`fleet serve --registry`, the one hosts are pointed at):
    tenants may name them, and unscoped credentials go to them."""
    private: tuple[Reference, ...] = ()
    """Repositories no tenant may name (the artifacts repository holds every tenant's
    uploads)."""
    allow: tuple[str, ...] = ()
    """`HOST[:PORT][/REPO]` a Smolfile may name besides the configured registries; their hosts
    are also where a registry may redirect."""
    insecure: frozenset[str] = frozenset()
    """`HOST[:PORT]` reached over plain HTTP."""
    credentials: Credentials = Credentials()
    timeout_s: float = 60.0
    max_blob_bytes: int = 64 << 30
    pull_timeout_s: float = 3600.0

    @classmethod
    def from_env(
        cls, configured: Iterable[str] = (), private: Iterable[str] = ()
    ) -> RegistryPolicy:
        """The policy of `FLEET_REGISTRY_*`, with the operator's registry repositories
        (`configured`) and those no tenant may name (`private`); empty ones are skipped."""
        settings = registry_settings()
        return cls(
            configured=tuple(Reference.parse(r) for r in configured if r),
            private=tuple(Reference.parse(r) for r in private if r),
            allow=_entries(settings.allow),
            insecure=frozenset(_entries(settings.insecure)),
            credentials=Credentials.parse(settings.auth),
            timeout_s=settings.timeout_s,
            max_blob_bytes=int(settings.max_blob_gib * (1 << 30)),
            pull_timeout_s=settings.pull_timeout_s,
        )  # fmt: skip

    def is_configured(self, netloc: str) -> bool:
        return any(c.netloc == netloc.lower() for c in self.configured)

    def check_tenant(self, ref: Reference) -> None:
        """Refuses a registry image a Smolfile names that the operator did not allow."""
        for repo in self.private:
            if repo.netloc == ref.netloc and _under(ref.repository, repo.repository):
                raise PermissionDenied(f"image {ref}: {repo} holds the fleet's artifacts; "
                                       "a Smolfile may not name it")  # fmt: skip
        if self.is_configured(ref.netloc):
            return
        for entry in self.allow:
            netloc, _, prefix = entry.partition("/")
            if netloc == ref.netloc and (not prefix or _under(ref.repository, prefix)):
                return
        allowed = sorted({c.netloc for c in self.configured} | set(self.allow))
        raise PermissionDenied(
            f"image {ref}: the registry {ref.netloc} is not one this fleet pulls from "
            f"(allowed: {', '.join(allowed) or 'none'}; an operator adds it to "
            "$FLEET_REGISTRY_ALLOW)"
        )

    def may_reach(self, origin: Reference, scheme: str, netloc: str) -> str:
        """Why a request of `origin`'s client may not go to `scheme://netloc` ("": it may):
        its own host, or a host on the allowlist (a redirect to a blob store), over HTTPS
        unless the host is listed as insecure."""
        netloc = netloc.lower()
        if "@" in netloc or not netloc:
            return f"{netloc!r} is not a registry address"
        if netloc != origin.netloc and netloc not in {e.partition("/")[0] for e in self.allow}:
            return f"{netloc} is not the registry's own host nor on $FLEET_REGISTRY_ALLOW"
        if scheme == "http" and netloc not in self.insecure:
            return (f"plain HTTP to {netloc} is refused (HTTPS, or an operator lists the host "
                    "in $FLEET_REGISTRY_INSECURE)")  # fmt: skip
        if scheme not in ("http", "https"):
            return f"{scheme}:// is not HTTP(S)"
        return ""


def _under(repository: str, prefix: str) -> bool:
    """`repository` is `prefix` or a repository below it (component-wise)."""
    repository, prefix = repository.lower(), prefix.lower().strip("/")
    return repository == prefix or repository.startswith(prefix + "/")
