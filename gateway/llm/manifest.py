"""A shipped language model's manifest, tokenizer and chat template.

`manifest.toml` is the model's identity for fleet: a name and revision, the sha256 of every
file beside it, and what serving needs besides weights (context length, the Jinja2 chat
template, stop tokens, the tool-call markers). The engine and the HTTP layer (and a CPU replica,
when there is one) all read the same manifest, so none can drift to another template or stop
rule.
Every file's checksum is verified on load: a corrupt or substituted file is refused by name
rather than served.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import structlog
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from fleet.core.errors import FailedPrecondition, InvalidArgument

log = structlog.get_logger(__name__)

MANIFEST_FILE = "manifest.toml"
TOKENIZER_FILE = "tokenizer.json"
REQUIRED_FILES = ("config.json", "model.safetensors", TOKENIZER_FILE)


@dataclass(frozen=True)
class ToolCall:
    """One call the model emitted: the tool's name and its arguments as JSON text (OpenAI's
    `function.arguments` is a string)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ModelManifest:
    """What `manifest.toml` states about a shipped model."""

    name: str
    revision: str
    directory: Path
    files: Mapping[str, str]
    """File name (relative to the directory) → sha256, all verified on load."""
    context_length: int
    chat_template: str
    stop_tokens: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    bos_token: str
    bos_token_id: int
    eos_token: str
    eos_token_id: int
    pad_token: str
    pad_token_id: int
    special_tokens: tuple[str, ...]
    """Role and control tokens, each a single token id, including the tool-call markers."""
    tool_call_start: str
    tool_call_end: str
    dtype: str
    parameters: int

    @property
    def model_id(self) -> str:
        """The name clients ask for (`fleet-tiny-chat-v1`)."""
        return f"{self.name}-{self.revision}"


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


@cache
def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled once. Templates are data shipped with weights: rendered
    sandboxed, `tojson` writes plain JSON (no HTML escaping) as chat templates elsewhere
    expect, and `raise_exception` lets a template refuse what it cannot render."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def render_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """Renders a chat template over OpenAI-style messages; InvalidArgument when the
    messages do not fit it."""
    try:
        return compile_template(source).render(
            messages=list(messages), tools=list(tools or []),
            add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token,
        )  # fmt: skip
    except jinja2.TemplateError as exc:
        raise InvalidArgument(f"messages: cannot render with the chat template: {exc}") from exc


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _field(data: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in data:
        raise FailedPrecondition(f"{where}: missing {key!r}")
    value = data[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FailedPrecondition(f"{where}: {key!r} must be a {kind.__name__}")
    return value


def _list(data: Mapping[str, Any], key: str, kind: type, where: str) -> tuple[Any, ...]:
    value = _field(data, key, list, where)
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        raise FailedPrecondition(f"{where}: {key!r} must be a list of {kind.__name__}")
    return tuple(value)


def load_manifest(directory: Path, verify: bool = True) -> ModelManifest:
    """The manifest of the model in `directory`, every listed file's sha256 checked (unless
    `verify` is false, for tools that rewrite a model). A missing or differing file is refused
    with FailedPrecondition naming it."""
    path = directory / MANIFEST_FILE
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise FailedPrecondition(f"cannot read model manifest {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise FailedPrecondition(f"{path}: not valid TOML: {exc}") from exc
    where = str(path)
    files = _field(data, "files", dict, where)
    for required in REQUIRED_FILES:
        if required not in files:
            raise FailedPrecondition(f"{where}: [files] lists no sha256 for {required}")
    manifest = ModelManifest(
        name=_field(data, "name", str, where),
        revision=_field(data, "revision", str, where),
        directory=directory,
        files={str(k): str(v) for k, v in files.items()},
        context_length=_field(data, "context_length", int, where),
        chat_template=_field(data, "chat_template", str, where),
        stop_tokens=_list(data, "stop_tokens", str, where),
        stop_token_ids=_list(data, "stop_token_ids", int, where),
        bos_token=_field(data, "bos_token", str, where),
        bos_token_id=_field(data, "bos_token_id", int, where),
        eos_token=_field(data, "eos_token", str, where),
        eos_token_id=_field(data, "eos_token_id", int, where),
        pad_token=_field(data, "pad_token", str, where),
        pad_token_id=_field(data, "pad_token_id", int, where),
        special_tokens=_list(data, "special_tokens", str, where),
        tool_call_start=_field(data, "tool_call_start", str, where),
        tool_call_end=_field(data, "tool_call_end", str, where),
        dtype=_field(data, "dtype", str, where),
        parameters=_field(data, "parameters", int, where),
    )
    if manifest.context_length <= 0:
        raise FailedPrecondition(f"{where}: context_length must be positive")
    if len(manifest.stop_tokens) != len(manifest.stop_token_ids):
        raise FailedPrecondition(f"{where}: stop_tokens and stop_token_ids differ in length")
    if verify:
        verify_files(manifest)
    return manifest


def verify_files(manifest: ModelManifest) -> None:
    """Checks each listed file's sha256; refuses the first that is missing or differs."""
    for name, expected in manifest.files.items():
        path = manifest.directory / name
        if path.parent.resolve() != manifest.directory.resolve():
            raise FailedPrecondition(
                f"{manifest.directory / MANIFEST_FILE}: {name!r} is not a file of the model "
                "directory"
            )
        try:
            digest = sha256_of(path)
        except OSError as exc:
            raise FailedPrecondition(
                f"model {manifest.model_id}: cannot read {name}: {exc}"
            ) from exc
        if digest != expected:
            raise FailedPrecondition(
                f"model {manifest.model_id}: {name} has sha256 {digest[:16]}…, the manifest "
                f"says {expected[:16]}…; refusing a corrupt or substituted file"
            )


def load_tokenizer(directory: Path, manifest: ModelManifest | None = None) -> Tokenizer:
    """The model's tokenizer, after the manifest's checksums were verified (pass the manifest
    already loaded to skip a second check). Refuses a tokenizer whose special tokens are not
    the single ids the manifest states."""
    manifest = manifest or load_manifest(directory)
    path = directory / TOKENIZER_FILE
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise FailedPrecondition(f"cannot read tokenizer {path}: {exc}") from exc
    expected = {
        manifest.bos_token: manifest.bos_token_id,
        manifest.eos_token: manifest.eos_token_id,
        manifest.pad_token: manifest.pad_token_id,
        **dict(zip(manifest.stop_tokens, manifest.stop_token_ids, strict=True)),
    }
    for token in manifest.special_tokens:
        expected.setdefault(token, -1)
    for token, token_id in expected.items():
        actual = tokenizer.token_to_id(token)
        if actual is None or (token_id >= 0 and actual != token_id):
            raise FailedPrecondition(
                f"{path}: token {token!r} is id {actual}, the manifest says {token_id}"
            )
    return tokenizer


def render_chat(
    manifest: ModelManifest,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of OpenAI-style messages (with tool calls and tool results) by the
    model's chat template; InvalidArgument when the messages do not fit it."""
    return render_template(
        manifest.chat_template, messages, tools, add_generation_prompt,
        bos_token=manifest.bos_token, eos_token=manifest.eos_token,
    )  # fmt: skip


def parse_tool_calls(text: str, start: str, end: str) -> tuple[str, list[ToolCall]]:
    """Splits generated text into its plain content and the tool calls between the markers
    (a manifest's `tool_call_start` and `tool_call_end`). A marked span that is not
    `{"name": str, "arguments": object}` JSON stays in the content, so nothing the model
    wrote is dropped."""
    pattern = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.S)
    calls: list[ToolCall] = []
    content: list[str] = []
    last = 0
    for match in pattern.finditer(text):
        call = _tool_call(match.group(1))
        if call is None:
            continue
        content.append(text[last : match.start()])
        calls.append(call)
        last = match.end()
    content.append(text[last:])
    return "".join(content), calls


def _tool_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some templates carry arguments already as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=data["name"], arguments=json.dumps(arguments, ensure_ascii=False))
