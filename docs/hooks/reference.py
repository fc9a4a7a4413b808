"""MkDocs hook: reference pages rendered from the code, so they cannot drift from it.

A page asks for a generated part with a marker on a line of its own:

    <!-- fleet-reference: cli -->          the `fleet` command, from its argparse parser
    <!-- fleet-reference: proto -->        the wire contract, from proto/fleet/v1/*.proto
    <!-- fleet-reference: smolfile -->     the Smolfile's keys, from its pydantic model
    <!-- fleet-reference: policy-rules --> the egress audit's rules, from fleet.core.policy
    <!-- fleet-reference: org-policy -->   the org policy's keys, from fleet.core.policy

An unknown marker fails the build. Everything is read locally (protoc runs in-process through
grpcio-tools); nothing is fetched.
"""

from __future__ import annotations

import argparse
import ast
import html
import json
import os
import re
import tempfile
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- fleet-reference: ([a-z-]+) -->$", re.MULTILINE)
USAGE_COLUMNS = "100"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replaces each marker with the part it names."""

    def render(found: re.Match[str]) -> str:
        name = found.group(1)
        renderer = RENDERERS.get(name)
        if renderer is None:
            raise PluginError(f"{page.file.src_path}: unknown reference marker {name!r}")
        return renderer()

    return MARKER.sub(render, markdown)


# -- shared ------------------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text for a Markdown table cell: HTML and Markdown's own characters escaped."""
    text = html.escape(" ".join(text.split()), quote=False)
    return re.sub(r"([\\`*_|\[\]])", r"\\\1", text)


# -- the CLI -----------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, Any]]:
    """(name, one-line help, parser) for each subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _argument(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    if action.nargs == 0:
        return ", ".join(f"`{o}`" for o in action.option_strings)
    metavar = action.metavar or action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if action.choices is not None and action.metavar is None:
        metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
    return ", ".join(f"`{o} {metavar}`" for o in action.option_strings)


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(str(c) for c in params["choices"])
        text = text % dict(params, prog=prog)
    if action.choices is not None and not action.option_strings and not text:
        text = "one of " + ", ".join(str(c) for c in action.choices)
    if action.required and action.option_strings:
        text = (text + " (required)").strip()
    return _cell(text) or "&nbsp;"


def _cli_section(parser: argparse.ArgumentParser, help_: str, depth: int) -> list[str]:
    hashes = "#" * min(depth + 1, 6)
    out = [f"{hashes} `{parser.prog}`", ""]
    description = parser.description or help_
    if description:
        out += [_cell(description), ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    rows = [
        a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        and a.help is not argparse.SUPPRESS
    ]
    if rows:
        out += ["| argument | what it is |", "|---|---|"]
        out += [f"| {_argument(a)} | {_help(a, parser.prog)} |" for a in rows]
        out.append("")
    subs = list(_subcommands(parser))
    if subs:
        out += ["| subcommand | what it does |", "|---|---|"]
        out += [f"| `{name}` | {_cell(h)} |" for name, h, _ in subs]
        out.append("")
    for _, sub_help, sub in subs:
        out += _cli_section(sub, sub_help, depth + 1)
    return out


def render_cli() -> str:
    """Every command and subcommand of `fleet`, as its parser defines them."""
    from fleet.cli.main import build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = USAGE_COLUMNS  # argparse wraps usage lines to the terminal's width
    try:
        parser = build_parser()
        out = ["| command | what it does |", "|---|---|"]
        for name, help_, _ in _subcommands(parser):
            out.append(f"| [`fleet {name}`](#fleet-{name}) | {_cell(help_)} |")
        out.append("")
        for _, help_, sub in _subcommands(parser):
            out += _cli_section(sub, help_, 1)
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before
    return "\n".join(out)


# -- the wire contract -------------------------------------------------------------------------

# Field numbers of descriptor.proto, as SourceCodeInfo paths use them.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM = 2, 3, 4
_ENUM_VALUE, _SERVICE_METHOD = 2, 2


def _descriptor_set() -> Any:
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    sources = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fleet.pb"
        code = protoc.main(
            [
                "protoc",
                f"-I{ROOT / 'proto'}",
                f"-I{include}",
                "--include_source_info",
                f"--descriptor_set_out={out}",
                *sources,
            ]
        )
        if code != 0:
            raise PluginError(f"protoc could not read proto/ (exit {code})")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _comment(comments: dict[tuple[int, ...], str], path: tuple[int, ...]) -> str:
    return comments.get(path, "")


def _prose(text: str) -> str:
    """A comment block as Markdown paragraphs (its own line breaks joined)."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip())]
    return "\n\n".join(html.escape(p, quote=False) for p in paragraphs if p)


def _type_link(type_name: str, known: set[str]) -> str:
    name = type_name.lstrip(".")
    short = name.removeprefix("fleet.v1.")
    if name in known:
        return f"[`{short}`](#{name})"
    return f"`{short}`"


_SCALARS = {
    1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 8: "bool", 9: "string",
    12: "bytes", 13: "uint32", 17: "sint32", 18: "sint64", 6: "fixed64", 7: "fixed32",
    15: "sfixed32", 16: "sfixed64",
}  # fmt: skip


def _field_type(field: Any, maps: dict[str, Any], known: set[str]) -> str:
    if field.type_name:
        entry = maps.get(field.type_name.lstrip("."))
        if entry is not None:  # a map<K, V> field is a repeated nested *Entry message
            key, value = entry.field[0], entry.field[1]
            inner = f"{_field_type(key, maps, known)}, {_field_type(value, maps, known)}"
            return f"map&lt;{inner}&gt;"
        base = _type_link(field.type_name, known)
    else:
        base = f"`{_SCALARS.get(field.type, str(field.type))}`"
    return f"repeated {base}" if field.label == 3 else base


def _walk_messages(
    prefix: str, messages: Any, path: tuple[int, ...], tag: int
) -> Iterator[tuple[str, Any, tuple[int, ...]]]:
    for i, message in enumerate(messages):
        name = f"{prefix}.{message.name}"
        here = (*path, tag, i)
        yield name, message, here
        yield from _walk_messages(name, message.nested_type, here, _MESSAGE_NESTED)


def _enum_section(
    name: str, enum: Any, path: tuple[int, ...], comments: dict[tuple[int, ...], str]
) -> list[str]:
    out = [f"### enum `{name.removeprefix('fleet.v1.')}` {{ #{name} }}", ""]
    if text := _comment(comments, path):
        out += [_prose(text), ""]
    out += ["| value | number | meaning |", "|---|---|---|"]
    for i, value in enumerate(enum.value):
        text = _comment(comments, (*path, _ENUM_VALUE, i))
        out.append(f"| `{value.name}` | {value.number} | {_cell(text) or '&nbsp;'} |")
    return [*out, ""]


def render_proto() -> str:
    """Services, their calls, messages and enums of every file under proto/, with comments."""
    fds = _descriptor_set()
    own = sorted((f for f in fds.file if f.name.startswith("fleet/")), key=lambda f: f.name)
    known: set[str] = set()
    maps: dict[str, Any] = {}
    for f in own:
        prefix = "." + f.package if f.package else ""
        for name, message, _ in _walk_messages(prefix, f.message_type, (), _FILE_MESSAGE):
            if message.options.map_entry:
                maps[name.lstrip(".")] = message
            else:
                known.add(name.lstrip("."))
        for enum in f.enum_type:
            known.add(f"{f.package}.{enum.name}")
        for name, message, _ in _walk_messages(prefix, f.message_type, (), _FILE_MESSAGE):
            known.update(f"{name.lstrip('.')}.{e.name}" for e in message.enum_type)
    out: list[str] = []
    for f in own:
        comments = {
            tuple(loc.path): loc.leading_comments or loc.trailing_comments
            for loc in f.source_code_info.location
            if loc.leading_comments or loc.trailing_comments
        }
        out += [f"## `proto/{f.name}`", ""]
        for s, service in enumerate(f.service):
            sname = f"{f.package}.{service.name}"
            known.add(sname)
            out += [f"### service `{service.name}` {{ #{sname} }}", ""]
            if text := _comment(comments, (_FILE_SERVICE, s)):
                out += [_prose(text), ""]
            out += ["| call | request | answer | what it does |", "|---|---|---|---|"]
            for m, method in enumerate(service.method):
                request = _type_link(method.input_type, known)
                answer = _type_link(method.output_type, known)
                request = f"stream {request}" if method.client_streaming else request
                answer = f"stream {answer}" if method.server_streaming else answer
                text = _comment(comments, (_FILE_SERVICE, s, _SERVICE_METHOD, m))
                out.append(
                    f"| `{method.name}` | {request} | {answer} | {_cell(text) or '&nbsp;'} |"
                )
            out.append("")
        prefix = "." + f.package
        for e, enum in enumerate(f.enum_type):
            out += _enum_section(f"{f.package}.{enum.name}", enum, (_FILE_ENUM, e), comments)
        for name, message, path in _walk_messages(prefix, f.message_type, (), _FILE_MESSAGE):
            if message.options.map_entry:
                continue
            full = name.lstrip(".")
            out += [f"### message `{full.removeprefix('fleet.v1.')}` {{ #{full} }}", ""]
            if text := _comment(comments, path):
                out += [_prose(text), ""]
            if message.field:
                out += ["| field | type | number | meaning |", "|---|---|---|---|"]
                for i, field in enumerate(message.field):
                    text = _comment(comments, (*path, _MESSAGE_FIELD, i))
                    kind = _field_type(field, maps, known)
                    if field.HasField("oneof_index") and not field.proto3_optional:
                        kind += f" (one of `{message.oneof_decl[field.oneof_index].name}`)"
                    out.append(
                        f"| `{field.name}` | {kind} | {field.number} | {_cell(text) or '&nbsp;'} |"
                    )
                out.append("")
            for e, enum in enumerate(message.enum_type):
                out += _enum_section(
                    f"{full}.{enum.name}", enum, (*path, _MESSAGE_ENUM, e), comments
                )
    return "\n".join(out)


# -- the Smolfile ------------------------------------------------------------------------------


def _describe_type(annotation: Any) -> tuple[str, str]:
    """(type, allowed values) of a model field's annotation, as a Smolfile writer reads it."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _describe_type(inner[0])
    if origin is typing.Annotated:
        kind, _ = _describe_type(args[0])
        bounds = []
        for meta in args[1:]:
            for item in getattr(meta, "metadata", [meta]):
                for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                    value = getattr(item, attr, None)
                    if value is not None:
                        bounds.append(f"{sign} {value:,}")
        return kind, ", ".join(bounds)
    if origin is typing.Literal:
        return "string", ", ".join(f'`"{a}"`' for a in args)
    if origin is list:
        return f"array of {_describe_type(args[0])[0]}s", ""
    if origin is dict:
        return "table", ""
    names = {str: "string", int: "integer", bool: "boolean", float: "number"}
    if annotation in names:
        return names[annotation], ""
    return getattr(annotation, "__name__", str(annotation)), ""


def _model_rows(model: Any, table: str) -> tuple[list[str], list[tuple[str, Any]]]:
    from pydantic import BaseModel

    rows: list[str] = []
    nested: list[tuple[str, Any]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        target = annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            target = args[0] if len(args) == 1 else annotation
        inner = typing.get_args(target)
        origin = typing.get_origin(target)
        if isinstance(target, type) and issubclass(target, BaseModel):
            nested.append((f"[{table}{name}]", target))
            continue
        if (
            origin is list
            and inner
            and isinstance(inner[0], type)
            and issubclass(inner[0], BaseModel)
        ):
            nested.append((f"[[{table}{name}]]", inner[0]))
            continue
        if origin is dict and len(inner) == 2 and issubclass(inner[1], BaseModel):
            nested.append((f"[{table}{name}.NAME]", inner[1]))
            continue
        kind, allowed = _describe_type(annotation)
        rows.append(f"| `{name}` | {kind} | {allowed or '&nbsp;'} |")
    return rows, nested


def render_smolfile() -> str:
    """Every key fleet accepts in a Smolfile, table by table, from fleet.core.smolfile."""
    from fleet.core import smolfile

    out: list[str] = []
    queue: list[tuple[str, Any]] = [("top level", smolfile.Smolfile)]
    while queue:
        title, model = queue.pop(0)
        table = title.strip("[]").replace(".NAME", "") + "." if title != "top level" else ""
        rows, nested = _model_rows(model, table)
        out += [f"### {'Top-level keys' if title == 'top level' else f'`{title}`'}", ""]
        doc = (model.__doc__ or "").strip()
        if doc and model is not smolfile.Smolfile:
            out += [_prose(doc), ""]
        out += ["| key | type | allowed |", "|---|---|---|", *rows, ""]
        queue.extend(nested)
    return "\n".join(out)


# -- the egress audit's rules ------------------------------------------------------------------


def render_policy_rules() -> str:
    """The audit's rule ids, severities and summaries, from fleet.core.policy.RULES."""
    from fleet.core.policy import RULES

    out = ["| rule | severity | finding |", "|---|---|---|"]
    out += [f"| `{r.id}` | {r.severity} | {_cell(r.summary)} |" for r in RULES.values()]
    return "\n".join(out)


def render_org_policy() -> str:
    """The org policy's keys, defaults and meanings, from fleet.core.policy.OrgPolicy (its
    attribute docstrings are read from the source: pydantic does not keep them)."""
    from fleet.core.policy import OrgPolicy

    source = ast.parse((ROOT / "fleet" / "core" / "policy.py").read_text())
    docs: dict[str, str] = {}
    for node in ast.walk(source):
        if isinstance(node, ast.ClassDef) and node.name == "OrgPolicy":
            body = node.body
            for statement, after in zip(body, [*body[1:], None], strict=True):
                if (
                    isinstance(statement, ast.AnnAssign)
                    and isinstance(statement.target, ast.Name)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                ):
                    docs[statement.target.id] = after.value.value
    out = ["| key | default | meaning |", "|---|---|---|"]
    for name, field in OrgPolicy.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "none" if default is None else f"`{json.dumps(default)}`"
        out.append(f"| `{name}` | {shown} | {_cell(docs.get(name, '')) or '&nbsp;'} |")
    return "\n".join(out)


RENDERERS: dict[str, Callable[[], str]] = {
    "cli": render_cli,
    "proto": render_proto,
    "smolfile": render_smolfile,
    "policy-rules": render_policy_rules,
    "org-policy": render_org_policy,
}
