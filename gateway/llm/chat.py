"""OpenAI-style chat on a shipped model: the prompt from messages by the model's own template,
the tools a request offers checked first, and tool calls parsed back out of what it writes.

The chat template is data shipped with the weights and rendered sandboxed (`manifest`). How the
model writes a call is fixed by its training: `tool_call_start` + `{"name": ..., "arguments":
{...}}` + `tool_call_end`, the markers named in the manifest. `tool_choice` is honoured in the
same terms: "none" offers no tools, "required" starts the answer with the start marker, and a
named function starts it with that function's call already opened, so the model only writes
the arguments. Those forced openings are part of the answer's text for parsing, never of what
the client is sent as content.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.core.errors import InvalidArgument
from gateway.llm.manifest import ModelManifest, parse_tool_calls, render_chat

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a function's name."""
MAX_TOOLS = 128
MAX_SCHEMA_DEPTH = 16
"""How deeply a tool's parameter schema may nest (objects and arrays within each other)."""
JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "array", "object", "null"})
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command and return its standard output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command line"}},
            "required": ["command"],
        },
    },
}
"""The tool the shipped model was trained to call (scripts/llm_transcripts), in OpenAI's
form: an agent offers it to get shell tool calls from fleet-tiny-chat-v1."""
"""Message roles taken; "developer" (OpenAI's newer name for system) is rendered as system."""


def check_tools(tools: object) -> list[dict[str, Any]]:
    """The request's `tools`, each a function with a name OpenAI would accept and parameters
    that are a JSON Schema object; InvalidArgument naming the first field at fault
    (`tools[2].function.parameters.properties.path.type`)."""
    if not isinstance(tools, list):
        raise InvalidArgument("tools: expected a list of tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools: {len(tools)} tools; at most {MAX_TOOLS}")
    seen: set[str] = set()
    checked: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidArgument(f"{where}: expected an object")
        if tool.get("type") != "function":
            raise InvalidArgument(f"{where}.type: must be 'function', not {tool.get('type')!r}")
        unknown = set(tool) - {"type", "function"}
        if unknown:
            raise InvalidArgument(f"{where}.{sorted(unknown)[0]}: not a field of a tool")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidArgument(f"{where}.function: expected an object")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise InvalidArgument(
                f"{where}.function.{sorted(unknown)[0]}: not a field of a function"
            )
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidArgument(
                f"{where}.function.name: {name!r} is not 1 to 64 letters, digits, '_' or '-'"
            )
        if name in seen:
            raise InvalidArgument(f"{where}.function.name: {name!r} is offered twice")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidArgument(f"{where}.function.description: expected a string")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidArgument(f"{where}.function.strict: expected true or false")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        _check_object_schema(parameters, f"{where}.function.parameters")
        checked.append({"type": "function", "function": dict(function, parameters=parameters)})
    return checked


def _check_object_schema(schema: object, where: str) -> None:
    """A function's parameters: an object schema (what a call's `arguments` must be)."""
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{where}: expected a JSON Schema object")
    if schema.get("type") != "object":
        raise InvalidArgument(
            f"{where}.type: a function's parameters must be of type 'object', not "
            f"{schema.get('type')!r}"
        )
    _check_schema(schema, where, 0)


def _check_schema(schema: object, where: str, depth: int) -> None:
    """The parts of JSON Schema a tool's arguments are described with, checked for shape:
    types by their names, properties as schemas, required names among the properties, items
    as a schema, enum as a list; other keywords are left as they are."""
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidArgument(f"{where}: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(schema, bool):  # (true / false are schemas too)
        return
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{where}: expected a JSON Schema (an object)")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in JSON_TYPES:
            raise InvalidArgument(
                f"{where}.type: {k!r} is not a JSON Schema type ({', '.join(sorted(JSON_TYPES))})"
            )
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            raise InvalidArgument(f"{where}.properties: expected an object of schemas")
        for name, sub in properties.items():
            _check_schema(sub, f"{where}.properties.{name}", depth + 1)
    required = schema.get("required")
    if required is not None:
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise InvalidArgument(f"{where}.required: expected a list of property names")
        missing = [r for r in required if r not in (properties or {})]
        if missing:
            raise InvalidArgument(f"{where}.required: {missing[0]!r} is not among its properties")
    if "items" in schema:
        _check_schema(schema["items"], f"{where}.items", depth + 1)
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise InvalidArgument(f"{where}.enum: expected a list")
    extra = schema.get("additionalProperties")
    if extra is not None:
        _check_schema(extra, f"{where}.additionalProperties", depth + 1)


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as the template takes it (OpenAI's message objects, "developer" as
    "system"); InvalidArgument naming the message and field that no chat can hold."""
    if not messages:
        raise InvalidArgument("messages: at least one message is needed")
    checked: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in ROLES:
            raise InvalidArgument(
                f"{where}.role: {role!r} is not one of {', '.join(sorted(ROLES))}"
            )
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise InvalidArgument(
                        f"{where}.content[{j}].type: only text parts are taken, not {kind!r}"
                    )
        elif content is not None and not isinstance(content, str):
            raise InvalidArgument(f"{where}.content: expected a string or a list of text parts")
        calls = message.get("tool_calls")
        if calls and role != "assistant":
            raise InvalidArgument(f"{where}.tool_calls: only an assistant message makes calls")
        if role in ("system", "developer", "user") and content is None:
            raise InvalidArgument(f"{where}.content: a {role} message needs content")
        if role == "assistant" and content is None and not calls:
            raise InvalidArgument(f"{where}.content: an assistant message needs content or calls")
        if role == "tool" and not message.get("tool_call_id"):
            raise InvalidArgument(f"{where}.tool_call_id: a tool message answers a call by its id")
        for j, call in enumerate(calls or []):
            arguments = call.get("function", {}).get("arguments")
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else None
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                raise InvalidArgument(
                    f"{where}.tool_calls[{j}].function.arguments: expected a JSON object, as text"
                )
        checked.append({**message, "role": "system" if role == "developer" else role})
    return checked


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered request: the prompt text and how to read the answer back."""

    text: str
    """The prompt, ending with the forced opening of a call when one is forced."""
    forced: str = ""
    """Text the answer starts with that the prompt already holds (a forced call's opening)."""
    tools: tuple[str, ...] = ()
    """Names of the tools offered; empty: the answer is read as plain content."""


def render_prompt(
    manifest: ModelManifest,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: object = None,
) -> ChatPrompt:
    """The prompt of a chat request by the model's template, with `tool_choice` applied; the
    messages and tools checked first (`check_messages`, `check_tools`)."""
    checked = check_messages(messages)
    offered = check_tools(tools) if tools else []
    names = tuple(t["function"]["name"] for t in offered)
    forced = ""
    if tool_choice is not None and not offered:
        raise InvalidArgument("tool_choice: it is only taken with tools")
    if tool_choice == "none":
        offered, names = [], ()
    elif tool_choice == "required":
        forced = manifest.tool_call_start
    elif isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidArgument(
                "tool_choice: expected 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}'
            )
        if name not in names:
            raise InvalidArgument(f"tool_choice.function.name: no tool named {name!r} is offered")
        forced = manifest.tool_call_start + '{"name": ' + json.dumps(name) + ', "arguments": '
    elif tool_choice not in (None, "auto"):
        raise InvalidArgument(f"tool_choice: {tool_choice!r} is not none, auto or required")
    text = render_chat(manifest, checked, offered or None)
    return ChatPrompt(text + forced, forced, names)


def call_id() -> str:
    """A fresh tool call id, in OpenAI's form."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    tool_calls: list[dict[str, Any]]


def parse_answer(manifest: ModelManifest, prompt: ChatPrompt, text: str) -> ParsedAnswer:
    """A whole answer's content and tool calls (OpenAI's objects, each with a fresh id). With
    no tools offered, everything the model wrote is content."""
    if not prompt.tools:
        return ParsedAnswer(text, [])
    content, calls = parse_tool_calls(
        prompt.forced + text, manifest.tool_call_start, manifest.tool_call_end
    )
    tool_calls = [
        {"id": call_id(), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]  # fmt: skip
    if prompt.forced and not tool_calls:
        content = text  # (the forced opening never closed: the client sees what was written)
    return ParsedAnswer(content if content or not tool_calls else None, tool_calls)


@dataclass
class AnswerStream:
    """An answer read as it is made: content is released as soon as it cannot be the start of
    a tool call; from the first start marker on, the rest is held and parsed at the end. What
    a client assembles from `push` and `finish` equals `parse_answer` of the whole text."""

    manifest: ModelManifest
    prompt: ChatPrompt
    text: str = ""
    sent: int = 0
    """Characters of `text` released as content."""
    held_from: int | None = None
    """Where the first start marker begins (held from there on), once seen; 0 from the start
    when the prompt forced a call's opening."""

    def __post_init__(self) -> None:
        if self.prompt.tools and self.prompt.forced:
            self.held_from = 0

    def push(self, piece: str) -> str:
        """Content that may be sent now."""
        self.text += piece
        if not self.prompt.tools:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        if self.held_from is not None:
            return ""
        marker = self.manifest.tool_call_start
        at = self.text.find(marker, max(0, self.sent - len(marker) + 1))
        if at >= 0:
            self.held_from = at
            out, self.sent = self.text[self.sent : at], at
            return out
        safe = len(self.text)
        for keep in range(min(len(marker) - 1, len(self.text)), 0, -1):
            if marker.startswith(self.text[-keep:]):  # (the marker may be arriving)
                safe = len(self.text) - keep
                break
        out, self.sent = self.text[self.sent : safe], max(self.sent, safe)
        return out

    def finish(self) -> ParsedAnswer:
        """The rest of the answer: content not yet sent, and the tool calls."""
        if self.held_from is None:
            rest, self.sent = self.text[self.sent :], len(self.text)
            return ParsedAnswer(rest, [])
        return parse_answer(self.manifest, self.prompt, self.text[self.held_from :])
