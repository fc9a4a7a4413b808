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
from typing import Any, Literal, Self, get_args, get_origin

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
