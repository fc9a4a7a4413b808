"""Each process's settings as one pydantic-settings model: its defaults, its documentation (the
fields' docstrings), its `FLEET_<PROCESS>_<NAME>` environment variables and its command-line
flags all come from the model, so each default is written once.

A flag given wins over its environment variable, which wins over the default. A value that is
not what the field takes is refused naming the flag or the variable it came from.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self, get_args, get_origin

from annotated_types import Ge, Gt
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict


@dataclass(frozen=True)
class Flag:
    """How a setting appears on the command line: its flag ("": `--field-name`), or none
    (`FLAG_NONE`: set from the environment or by code only)."""

    name: str = ""
    metavar: str = ""


NO_FLAG = Flag(name="-")


class Settings(BaseSettings):
    """A process's settings (subclasses set `env_prefix`, e.g. FLEET_SERVE_)."""

    model_config = SettingsConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, env_ignore_empty=True
    )

    @classmethod
    def flags(cls) -> dict[str, Flag]:
        """The flag of each field that has one, by field name."""
        out = {}
        for name, info in cls.model_fields.items():
            flag = next((m for m in info.metadata if isinstance(m, Flag)), Flag())
            if flag != NO_FLAG:
                out[name] = flag
        return out

    @classmethod
    def env_name(cls, field: str) -> str:
        return f"{cls.model_config.get('env_prefix', '')}{field}".upper()

    @classmethod
    def add_flags(
        cls, parser: argparse.ArgumentParser, *, skip: frozenset[str] = frozenset()
    ) -> None:
        """One flag per field (those not in `skip`), its help the field's docstring with its
        default and environment variable."""
        for name, flag in cls.flags().items():
            if name in skip:
                continue
            info = cls.model_fields[name]
            option = flag.name or "--" + name.replace("_", "-")
            metavar = flag.metavar or option.lstrip("-").replace("-", "_").upper()
            parser.add_argument(option, dest=name, default=argparse.SUPPRESS,
                                help=_help(cls, name, info),
                                **_kind(info, Flag(flag.name, metavar)))  # fmt: skip

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> Self:
        """The settings from the flags given (`args`), then the environment, then the defaults;
        `given` (code's own values) over all of them. Raises SettingsError naming the flag or
        variable a bad value came from."""
        values = {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)}
        values.update(given)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise SettingsError(_explain(cls, exc, set(values))) from None


class SettingsError(ValueError):
    """A setting's value is not what it takes; the message names where it came from."""


def _explain(cls: type[Settings], exc: ValidationError, from_flags: set[str]) -> str:
    lines = []
    flags = cls.flags()
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        flag = (flags[field].name or "--" + field.replace("_", "-")) if field in flags else ""
        if error["type"] == "missing":
            where = f"{flag} (or ${cls.env_name(field)})" if flag else f"${cls.env_name(field)}"
        elif field in from_flags and flag:
            where = flag
        elif os.environ.get(cls.env_name(field)):
            where = f"${cls.env_name(field)}"
        else:
            where = field
        got = "" if error["type"] == "missing" else f" (got {error.get('input')!r})"
        lines.append(f"{where}: {error['msg']}{got}")
    return "; ".join(lines)


def _help(cls: type[Settings], name: str, info: FieldInfo) -> str:
    doc = " ".join((info.description or "").split())
    default = info.default
    if info.is_required():
        shown = "required; "
    elif (
        info.default_factory is not None
        or default is None
        or default is False
        or default == ""
        or default == []
    ):
        shown = ""
    else:
        shown = f"default {default}; "
    return f"{doc} ({shown}${cls.env_name(name)})".replace("%", "%%")


def _kind(info: FieldInfo, flag: Flag) -> dict[str, Any]:
    """argparse's type, action and choices for a field's annotation."""
    annotation = info.annotation
    if get_origin(annotation) in (typing.Union, types.UnionType):  # X | None: X
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    extra: dict[str, Any] = {"metavar": flag.metavar} if flag.metavar else {}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(annotation) in (list, tuple):
        return {"action": "append", **extra}
    if get_origin(annotation) is Literal:
        return {"choices": list(get_args(annotation))}
    if annotation in (int, float):
        return {"type": annotation, **extra}
    return extra


class RegistrySettings(Settings):
    """How this process talks to OCI registries, from `FLEET_REGISTRY_*` (the server, agents
    and the CLI read the same variables). A tenant's Smolfile may name a registry image, so
    what is reached, with which credentials and over what, is the operator's to say."""

    model_config = SettingsConfigDict(env_prefix="FLEET_REGISTRY_")

    auth: str = ""
    """Registry credentials: `user:password` for the registries this process was configured
    with (`fleet serve --registry`/`--artifacts-registry`, the registry an agent is pointed at,
    the one a `fleet image` command names), or `HOST[:PORT]=user:password` entries separated
    by spaces, each sent to that registry only."""
    allow: str = ""
    """Registries a Smolfile may name besides the configured one: `HOST[:PORT][/REPO]`
    entries separated by commas or spaces (a REPO limits the entry to repositories under it).
    Also the hosts a registry may redirect to besides its own."""
    insecure: str = ""
    """`HOST[:PORT]` entries (commas or spaces) that may be reached over plain HTTP; every other
    registry over HTTPS only."""
    timeout_s: Annotated[float, Gt(0)] = 60.0
    """How long one registry request may wait to connect or for the next bytes."""
    max_blob_gib: Annotated[float, Gt(0)] = 64.0
    """The largest layer pulled from a registry (and its unpacked size), past which the pull
    stops and what it wrote is deleted."""
    pull_timeout_s: Annotated[float, Gt(0)] = 3600.0
    """How long one blob download may take in all."""
    resolve_timeout_s: Annotated[float, Gt(0)] = 30.0
    """How long the server spends resolving a Smolfile's registry image at submission
    (waiting for a slot included), after which the submission is refused as unavailable."""
    resolves_per_tenant: Annotated[int, Gt(0)] = 2
    """Registry resolutions one tenant's submissions run at once on the server (the others
    wait for a slot)."""
    resolve_cache_s: Annotated[float, Ge(0)] = 30.0
    """How long the server reuses a registry image's resolution (0: never)."""


class ArtifactSettings(Settings):
    """Bounds of the server's artifact store, from `FLEET_ARTIFACTS_*`."""

    model_config = SettingsConfigDict(env_prefix="FLEET_ARTIFACTS_")

    tenant_quota_gib: Annotated[float, Ge(0)] = 20.0
    """Bytes one tenant's uploads (PutBlob) may hold in the store at once, until retention
    frees those no rollout names (0: no quota)."""
