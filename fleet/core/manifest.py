"""Manifests: the immutable record of everything a rollout (and every retry of it) runs."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleet.core.errors import InvalidArgument, ResourceExhausted
from fleet.core.placement import HostClass, Requirements, host_class_for
from fleet.core.retry import RetryPolicy
from fleet.core.smolfile import ParsedSmolfile, parse_smolfile

MAX_STEPS = 256
MAX_PLAN_BYTES = 256 * 1024
MAX_LABELS = 64
DEFAULT_STEP_TIMEOUT_S = 300.0
DEFAULT_DEADLINE = timedelta(hours=1)


class Step(BaseModel):
    """One command of a plan: argv, env, workdir and a timeout."""

    model_config = ConfigDict(frozen=True)

    argv: tuple[str, ...]
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None
    timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    name: str = ""


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

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> Manifest:
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("digest", None)  # a copy with changes gets its own digest
        return copy

    @cached_property
    def digest(self) -> str:
        """Content digest (computed once: the model is frozen)."""
        body = self.model_dump_json(exclude={"smolfile_name"})
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
        blob = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def validate_request(request: SubmitRequest, now: datetime) -> ParsedSmolfile:
    """Checks everything about a submission that needs no I/O; returns the parsed Smolfile."""
    if not request.idempotency_key.strip():
        raise InvalidArgument("idempotency_key is empty: every submission needs one")
    if len(request.idempotency_key) > 256:
        raise InvalidArgument("idempotency_key is longer than 256 characters")
    parsed = parse_smolfile(request.smolfile, request.smolfile_name)
    if not parsed.spec.image:
        raise InvalidArgument(f"{request.smolfile_name}: the Smolfile names no image")
    if not request.steps:
        raise InvalidArgument("the plan has no steps")
    if len(request.steps) > MAX_STEPS:
        raise ResourceExhausted(f"the plan has {len(request.steps)} steps, over the {MAX_STEPS}")
    size = sum(len(a.encode()) for s in request.steps for a in s.argv) + sum(
        len(k) + len(v) for s in request.steps for k, v in s.env.items()
    )
    if size > MAX_PLAN_BYTES:
        raise ResourceExhausted(f"the plan is {size} bytes, over the {MAX_PLAN_BYTES} limit")
    for index, step in enumerate(request.steps):
        where = f"step {index} ({step.name})" if step.name else f"step {index}"
        if not step.argv:
            raise InvalidArgument(f"{where}: argv is empty")
        if not step.argv[0]:
            raise InvalidArgument(f"{where}: argv[0] (the program) is empty")
        if step.timeout_s <= 0:
            raise InvalidArgument(f"{where}: timeout_s must be positive, got {step.timeout_s}")
        if step.workdir is not None and not step.workdir.startswith("/"):
            raise InvalidArgument(f"{where}: workdir {step.workdir!r} is not an absolute path")
        for key in step.env:
            if not key or "=" in key or "\0" in key:
                raise InvalidArgument(f"{where}: env key {key!r} is not a variable name")
    if request.deadline is not None:
        if request.deadline.tzinfo is None:
            raise InvalidArgument("deadline has no time zone")
        if request.deadline <= now:
            raise InvalidArgument(
                f"deadline {request.deadline.isoformat()} is in the past "
                f"(server time {now.isoformat()})"
            )
    if len(request.labels) > MAX_LABELS:
        raise InvalidArgument(f"{len(request.labels)} labels, over the limit of {MAX_LABELS}")
    return parsed


def build_manifest(
    request: SubmitRequest, parsed: ParsedSmolfile, image_digest: str, now: datetime
) -> Manifest:
    """The manifest a validated request runs, with its image pinned by digest."""
    deadline = request.deadline or (now + DEFAULT_DEADLINE)
    return Manifest(
        smolfile=parsed.text,
        smolfile_name=parsed.name,
        smolfile_digest=parsed.digest,
        image_ref=parsed.spec.image or "",
        image_digest=image_digest,
        steps=request.steps,
        deadline=deadline.astimezone(UTC),
        retry=request.retry,
        versions=request.versions,
        requirements=request.requirements,
        host_class=host_class_for(parsed.spec, request.requirements),
    )
