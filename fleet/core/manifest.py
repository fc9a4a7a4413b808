"""Manifests: the immutable record of everything a rollout (and every retry of it) runs."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fleet.core.errors import InvalidArgument, ResourceExhausted
from fleet.core.placement import HostClass, Requirements, host_class_for
from fleet.core.retry import RetryPolicy
from fleet.core.smolfile import ENV_NAME_RULE, ParsedSmolfile, is_env_name, parse_smolfile

MAX_STEPS = 256
MAX_PLAN_BYTES = 256 * 1024
MAX_LABELS = 64
MAX_LABEL_KEY = 128
MAX_LABEL_VALUE = 256
MAX_NAME = 256
"""Characters in a tenant, a version string, a step's name or a Smolfile's name."""
DEFAULT_STEP_TIMEOUT_S = 300.0
MAX_STEP_TIMEOUT_S = 7 * 24 * 3600.0
DEFAULT_DEADLINE = timedelta(hours=1)
MAX_DEADLINE = timedelta(days=7)
"""How far ahead a deadline may be, by default (`fleet serve --max-deadline`)."""
MIN_PRIORITY, MAX_PRIORITY = -100, 100
"""The range of a submission's `priority` (higher is leased first; 0 by default)."""
MAX_MODELS = 16
"""Upstream models one rollout may name (they ride in its inference token)."""
MAX_MODEL_NAME = 128
MODEL_RULE = (
    "UPSTREAM/MODEL: an upstream's name (letters, digits, '.', '_', '-'), '/', then the model's "
    "name (letters, digits and '.', '_', '-', ':', '/', '@', '+'), or UPSTREAM/* for all of "
    "its models"
)
MAX_TOKEN_BUDGET = 10**12
"""The largest token budget a rollout may set (a bound no run reaches, that every JSON reader
and the token's claims hold as an exact integer)."""
BUDGETS = ("max_prompt_tokens", "max_completion_tokens")
"""A rollout's token budgets: totals over all of its model calls through the gateway."""
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}/(\*|[A-Za-z0-9][A-Za-z0-9._:/@+-]*)")


class Step(BaseModel):
    """One command of a plan: argv, env, workdir and a timeout."""

    model_config = ConfigDict(frozen=True)

    argv: tuple[str, ...]
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    name: str = ""


_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), check_circular=False)
"""What a request's fingerprint is the digest of: `json.dumps(body, sort_keys=True,
separators=(",", ":"))`, byte for byte (one encoder for every call, not one made per call; a
model's dump holds no cycles to look for)."""

DEFAULT_IMAGE = "minimal"
"""What a Smolfile that names no image runs on (smolvm, too, runs one without)."""
MAX_FILES = 64
"""Inputs, and outputs, one rollout may name."""
DIGEST_CHARS = frozenset("0123456789abcdef")


class InputFile(BaseModel):
    """A file, or a directory as one tar, uploaded by digest and placed at `path` read-only."""

    model_config = ConfigDict(frozen=True)

    path: str
    digest: str
    size: int
    directory: bool = False


class OutputArtifact(BaseModel):
    """What an attempt collected at one output path (`digest` empty: see `error`)."""

    model_config = ConfigDict(frozen=True)

    path: str
    digest: str = ""
    size: int = 0
    directory: bool = False
    error: str = ""


def is_digest(text: str) -> bool:
    return text.startswith("sha256:") and len(text) == 71 and set(text[7:]) <= DIGEST_CHARS


def check_machine_path(path: str, where: str) -> str:
    """An absolute, normalised path in the machine (no `..`, no NUL, not `/`)."""
    parts = path.split("/")
    if (
        not path.startswith("/")
        or path == "/"
        or "\0" in path
        or len(path) > 1024
        or any(p in ("..", ".") for p in parts)
        or "//" in path
        or path.endswith("/")
    ):
        raise InvalidArgument(
            f"{where}: {path[:200]!r} must be an absolute, normalised path in the machine "
            "(no '..', '.', '//', trailing '/' or NUL; not '/')"
        )
    return path


class SessionSpec(BaseModel):
    """An interactive session's terms: its machine is held for the caller's calls until it is
    closed, idle for `idle_timeout_s`, or past the manifest's deadline."""

    model_config = ConfigDict(frozen=True)

    idle_timeout_s: float = 600.0
    fork_of: str = ""
    """A fork: the session (rollout id) whose machine it starts as a copy of."""
    host: str = ""
    """A fork's host: the one holding its source's machine (it runs there or nowhere)."""
    layer: str = ""
    """A resumed session (or a fork of a parked one): the digest of the writable-layer archive
    its machine starts from (`fleet.runtime.layers`); its processes did not carry over."""
    layer_size: int = 0
    on_idle: Literal["park", "close"] = "park"
    """What the session does once idle: park (its disk kept, to resume) or close."""

    def unset_added(self) -> set[str]:
        """The fields added after sessions were first stored that hold their defaults: left out
        of a manifest's digest, so the digests of manifests stored before them do not change."""
        return {
            name for name in SESSION_ADDED
            if getattr(self, name) == SessionSpec.model_fields[name].default
        }  # fmt: skip


SESSION_ADDED = ("layer", "layer_size", "on_idle")
SESSION_LAYER_OUTPUT = "<session layer>"
"""The output a parked session's attempt reports its stored writable layer under."""


DEFAULT_SESSION_LIFETIME = timedelta(hours=1)
MAX_SESSION_IDLE_S = 24 * 3600.0


class Versions(BaseModel):
    """The versions the submitter names: a retry reuses them, a change is a new rollout."""

    model_config = ConfigDict(frozen=True)

    policy: str = ""
    environment: str = ""
    evaluator: str = ""


class Manifest(BaseModel):
    """Immutable and content-addressed: `digest` covers every other field."""

    model_config = ConfigDict(frozen=True)

    smolfile: str
    smolfile_name: str
    smolfile_digest: str
    image_ref: str
    image_digest: str
    steps: tuple[Step, ...]
    deadline: datetime
    retry: RetryPolicy
    versions: Versions
    requirements: Requirements
    host_class: HostClass
    inputs: tuple[InputFile, ...] = ()
    outputs: tuple[str, ...] = ()
    session: SessionSpec | None = None
    """Set for an interactive session (no steps)."""
    models: tuple[str, ...] = ()
    """The upstream models its machines may call through the gateway (`MODEL_RULE`)."""
    max_prompt_tokens: int = 0
    """Prompt tokens its model calls through the gateway may take in all (0: no budget)."""
    max_completion_tokens: int = 0
    """Completion tokens its model calls through the gateway may take in all (0: none)."""

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> Manifest:
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("digest", None)  # a copy with changes gets its own digest
        return copy

    @cached_property
    def digest(self) -> str:
        """Content digest (computed once: the model is frozen)."""
        # Inputs and outputs came later: left out when there are none, so the digests of
        # manifests stored before them do not change.
        added = {
            name
            for name in ("inputs", "outputs", "session", "models", *BUDGETS)
            if not getattr(self, name)
        }
        exclude: dict[str, Any] = {name: True for name in ("smolfile_name", *added)}
        if self.session is not None and self.session.unset_added():
            exclude["session"] = self.session.unset_added()
        body = self.model_dump_json(exclude=exclude)
        return "sha256:" + hashlib.sha256(body.encode()).hexdigest()

    def parsed_smolfile(self) -> ParsedSmolfile:
        return parse_smolfile(self.smolfile, self.smolfile_name)


class SubmitRequest(BaseModel):
    """A rollout as the submitter asked for it (before the image is resolved)."""

    model_config = ConfigDict(frozen=True)

    idempotency_key: str
    smolfile: str
    smolfile_name: str = "<smolfile>"
    steps: tuple[Step, ...]
    deadline: datetime | None = None
    retry: RetryPolicy = RetryPolicy()
    versions: Versions = Versions()
    labels: dict[str, str] = Field(default_factory=dict)
    tenant: str = "default"
    requirements: Requirements = Requirements()
    priority: int = 0
    inputs: tuple[InputFile, ...] = ()
    outputs: tuple[str, ...] = ()
    session: SessionSpec | None = None
    models: tuple[str, ...] = ()
    """The upstream models its machines may call through the gateway (`MODEL_RULE`)."""
    max_prompt_tokens: int = 0
    """Prompt tokens its model calls through the gateway may take in all (0: no budget)."""
    max_completion_tokens: int = 0
    """Completion tokens its model calls through the gateway may take in all (0: none)."""

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> SubmitRequest:
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("body_fingerprint", None)
        return copy

    def fingerprint(self) -> str:
        """Digest of the body: the same key must always come with the same fingerprint."""
        return self.body_fingerprint

    @cached_property
    def body_fingerprint(self) -> str:
        body = self.model_dump(mode="json", exclude={"idempotency_key"})
        for added in ("inference", "near_gateway"):
            # Added after the first schema: left out when unset, so a body's fingerprint (and
            # an idempotent retry across an upgrade) does not change.
            if not body["requirements"][added]:
                del body["requirements"][added]
        for added in ("inputs", "outputs", "session", "models", *BUDGETS):
            if not body[added]:
                del body[added]
        if self.session is not None:
            # A session's deadline is the time of the call plus its lifetime: a repeat of the
            # call (to wait longer for its machine) comes later with the same body otherwise.
            del body["deadline"]
        blob = _CANONICAL_JSON.encode(body)
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def check_text(value: str, where: str, limit: int = MAX_NAME) -> None:
    """A short identifier-like string: at most `limit` characters, no NUL."""
    if len(value) > limit:
        raise InvalidArgument(f"{where} is {len(value)} characters, over the limit of {limit}")
    if "\0" in value:
        raise InvalidArgument(f"{where} holds a NUL character")


def check_steps(steps: tuple[Step, ...]) -> None:
    """Every step runnable as written: argv, env, workdir and timeout (also checked by agents,
    so that a plan that slipped past a server is refused as malformed, not retried)."""
    if not steps:
        raise InvalidArgument("the plan has no steps")
    if len(steps) > MAX_STEPS:
        raise ResourceExhausted(f"the plan has {len(steps)} steps, over the {MAX_STEPS}")
    size = sum(len(a.encode()) for s in steps for a in s.argv) + sum(
        len(k) + len(v) for s in steps for k, v in s.env.items()
    )
    if size > MAX_PLAN_BYTES:
        raise ResourceExhausted(f"the plan is {size} bytes, over the {MAX_PLAN_BYTES} limit")
    for index, step in enumerate(steps):
        where = f"step {index} ({step.name[:64]})" if step.name else f"step {index}"
        check_text(step.name, f"step {index}: name")
        if not step.argv:
            raise InvalidArgument(f"{where}: argv is empty")
        if not step.argv[0]:
            raise InvalidArgument(f"{where}: argv[0] (the program) is empty")
        for i, arg in enumerate(step.argv):
            if "\0" in arg:
                raise InvalidArgument(f"{where}: argv[{i}] holds a NUL character")
        if not math.isfinite(step.timeout_s) or step.timeout_s <= 0:
            raise InvalidArgument(f"{where}: timeout_s must be positive, got {step.timeout_s}")
        if step.timeout_s > MAX_STEP_TIMEOUT_S:
            raise InvalidArgument(
                f"{where}: timeout_s {step.timeout_s:g} is over the limit of "
                f"{MAX_STEP_TIMEOUT_S:g} (7 days)"
            )
        if step.workdir is not None:
            if not step.workdir.startswith("/"):
                raise InvalidArgument(
                    f"{where}: workdir {step.workdir[:200]!r} is not an absolute path"
                )
            check_text(step.workdir, f"{where}: workdir", 4096)
        for key, value in step.env.items():
            if not key or "=" in key or "\0" in key:
                raise InvalidArgument(f"{where}: env key {key[:100]!r} is not a variable name")
            if "\0" in value:
                raise InvalidArgument(f"{where}: env {key[:100]}'s value holds a NUL character")


def check_env_names(steps: tuple[Step, ...]) -> None:
    """Every step's env names portable variable names, checked at submission (agents run
    plans accepted before this rule as they were)."""
    for index, step in enumerate(steps):
        for key in step.env:
            if not is_env_name(key):
                where = f"step {index} ({step.name[:64]})" if step.name else f"step {index}"
                raise InvalidArgument(
                    f"{where}: env name {key[:100]!r} is not a variable name ({ENV_NAME_RULE})"
                )


def validate_request(
    request: SubmitRequest, now: datetime, max_deadline: timedelta = MAX_DEADLINE
) -> ParsedSmolfile:
    """Checks everything about a submission that needs no I/O; returns the parsed Smolfile."""
    if not request.idempotency_key.strip():
        raise InvalidArgument("idempotency_key is empty: every submission needs one")
    check_text(request.idempotency_key, "idempotency_key")
    check_text(request.tenant, "tenant", 128)
    check_text(request.smolfile_name, "smolfile_name")
    for name in ("policy", "environment", "evaluator"):
        check_text(getattr(request.versions, name), f"versions.{name}")
    if len(request.labels) > MAX_LABELS:
        raise InvalidArgument(f"{len(request.labels)} labels, over the limit of {MAX_LABELS}")
    for key, value in request.labels.items():
        check_text(key, f"labels key {key[:64]!r}", MAX_LABEL_KEY)
        check_text(value, f"labels[{key[:64]!r}]", MAX_LABEL_VALUE)
    if not MIN_PRIORITY <= request.priority <= MAX_PRIORITY:
        raise InvalidArgument(
            f"priority {request.priority} is out of range: it must be from {MIN_PRIORITY} to "
            f"{MAX_PRIORITY} (higher is leased first; 0 by default)"
        )
    if request.session is None:
        check_steps(request.steps)  # counts and sizes before the Smolfile's parse
        check_env_names(request.steps)
    else:
        idle = request.session.idle_timeout_s
        if request.steps:
            raise InvalidArgument("a session has no steps: its commands come as calls")
        if not math.isfinite(idle) or not 0 < idle <= MAX_SESSION_IDLE_S:
            raise InvalidArgument(
                f"idle_timeout_s must be in (0, {MAX_SESSION_IDLE_S:g}], got {idle}"
            )
        if request.session.layer and not is_digest(request.session.layer):
            raise InvalidArgument(
                f"session.layer {request.session.layer[:80]!r} is not sha256:<64 hex digits>"
            )
    parsed = parse_smolfile(request.smolfile, request.smolfile_name)
    if request.deadline is not None:
        if request.deadline.tzinfo is None:
            raise InvalidArgument("deadline has no time zone")
        if request.deadline <= now:
            raise InvalidArgument(
                f"deadline {request.deadline.isoformat()} is in the past "
                f"(server time {now.isoformat()})"
            )
        if request.deadline > now + max_deadline:
            raise InvalidArgument(
                f"deadline {request.deadline.isoformat()} is more than {max_deadline} ahead "
                f"(server time {now.isoformat()}); the server's limit is --max-deadline"
            )
    check_files(request, parsed)
    check_models(request)
    check_budgets(request)
    return parsed


def check_budgets(request: SubmitRequest) -> None:
    """A rollout's token budgets: whole numbers from 0 (none) to MAX_TOKEN_BUDGET, and only
    with `inference` (the gateway enforces them from the token's claims, which only such a
    rollout gets)."""
    for name in BUDGETS:
        value = getattr(request, name)
        if not 0 <= value <= MAX_TOKEN_BUDGET:
            raise InvalidArgument(
                f"{name} {value} is out of range: it must be from 0 (no budget) to "
                f"{MAX_TOKEN_BUDGET}"
            )
        if value and not request.requirements.inference:
            raise InvalidArgument(
                f"{name}: only a rollout that calls the inference gateway "
                "(requirements.inference, fleet submit --inference) has a token budget"
            )


def check_models(request: SubmitRequest) -> None:
    """The upstream models a rollout names: only with `inference`, few, short, well formed and
    each named once (they are signed into its token and matched by the gateway as written)."""
    if not request.models:
        return
    if not request.requirements.inference:
        raise InvalidArgument(
            "models: only a rollout that calls the inference gateway (requirements.inference, "
            "fleet submit --inference) may name upstream models"
        )
    if len(request.models) > MAX_MODELS:
        raise InvalidArgument(
            f"models: {len(request.models)} named, over the limit of {MAX_MODELS}"
        )
    for index, name in enumerate(request.models):
        where = f"models[{index}]"
        if not name:
            raise InvalidArgument(f"{where} is empty: expected {MODEL_RULE}")
        if len(name) > MAX_MODEL_NAME:
            raise InvalidArgument(
                f"{where} is {len(name)} characters, over the limit of {MAX_MODEL_NAME}"
            )
        if not _MODEL_NAME.fullmatch(name):
            raise InvalidArgument(f"{where} {name[:80]!r} is not {MODEL_RULE}")
    if len(set(request.models)) != len(request.models):
        raise InvalidArgument("models: a model is named twice")


def image_of(parsed: ParsedSmolfile) -> str:
    """The Smolfile's image, or fleet's default image when it names none."""
    return parsed.spec.image or DEFAULT_IMAGE


def check_files(request: SubmitRequest, parsed: ParsedSmolfile) -> None:
    """Inputs and outputs: absolute paths, digests, no two at one path, not too many."""
    for name, items in (("inputs", request.inputs), ("outputs", request.outputs)):
        if len(items) > MAX_FILES:
            raise InvalidArgument(f"{name}: at most {MAX_FILES}, got {len(items)}")
    seen: set[str] = set()
    for index, item in enumerate(request.inputs):
        where = f"inputs[{index}]"
        check_machine_path(item.path, f"{where}.path")
        if not is_digest(item.digest):
            raise InvalidArgument(f"{where}.digest {item.digest[:80]!r} is not sha256:<64 hex>")
        if item.size < 0:
            raise InvalidArgument(f"{where}.size is negative")
        if item.path in seen:
            raise InvalidArgument(f"{where}.path {item.path!r} is named twice")
        seen.add(item.path)
    for index, path in enumerate(request.outputs):
        check_machine_path(path, f"outputs[{index}]")
    if len(set(request.outputs)) != len(request.outputs):
        raise InvalidArgument("outputs: a path is named twice")
    if request.inputs and parsed.spec.branch is not None and parsed.spec.branch.enabled:
        raise InvalidArgument(
            "inputs are not placed in a warm parent's children yet: submit without "
            "[branch] enabled, or bake the data into the warm-up"
        )


def build_manifest(
    request: SubmitRequest, parsed: ParsedSmolfile, image_digest: str, now: datetime,
    image_ref: str = "",
) -> Manifest:  # fmt: skip
    """The manifest a validated request runs, with its image pinned by digest (and a registry
    reference pinned to its manifest's digest in `image_ref`)."""
    deadline = request.deadline or (now + DEFAULT_DEADLINE)
    return Manifest(
        smolfile=parsed.text,
        smolfile_name=parsed.name,
        smolfile_digest=parsed.digest,
        image_ref=image_ref or image_of(parsed),
        image_digest=image_digest,
        steps=request.steps,
        deadline=deadline.astimezone(UTC),
        retry=request.retry,
        versions=request.versions,
        requirements=request.requirements,
        inputs=request.inputs,
        outputs=request.outputs,
        session=request.session,
        models=request.models,
        max_prompt_tokens=request.max_prompt_tokens,
        max_completion_tokens=request.max_completion_tokens,
        host_class=host_class_for(parsed.spec, request.requirements),
    )
