"""Property tests: no input makes the Smolfile parser, the plan loader or the protobuf-to-domain
conversion raise anything but fleet's own errors."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.api import convert
from fleet.api.pb import fleet_pb2, types_pb2
from fleet.cli.client import parse_plan
from fleet.core.errors import FleetError
from fleet.core.manifest import validate_request
from fleet.core.smolfile import parse_smolfile

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Strings that reach the interesting corners: NUL and other control characters, quotes, long.
nasty = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "\0", "a\0b", "..", "/", "//x", "minimal", "x" * 5000, "\u202e", "\\"]),
)
toml_scalar = st.one_of(
    nasty.map(lambda s: '"' + s.replace("\\", "\\\\").replace('"', '\\"')
              .replace("\0", "\\u0000").replace("\n", "\\n") + '"'),
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(
        lambda f: "nan" if f != f else ("inf" if f == float("inf") else
                                        "-inf" if f == float("-inf") else repr(f))
    ),
    st.booleans().map(lambda b: "true" if b else "false"),
)  # fmt: skip
toml_value = st.recursive(
    toml_scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.dictionaries(st.sampled_from(["a", "from_env", "enabled", "image"]), inner,
                        max_size=3).map(
            lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}"
        ),
    ),
    max_leaves=8,
)  # fmt: skip
SMOLFILE_KEYS = [
    "image", "entrypoint", "cmd", "env", "workdir", "user", "cpus", "memory", "storage",
    "overlay", "net", "gpu", "gpu_vram", "cuda", "init", "secrets", "bogus",
]  # fmt: skip
SECTIONS = ["network", "dev", "branch", "health", "restart", "artifact", "secrets", "x"]


@st.composite
def smolfile_text(draw: st.DrawFn) -> str:
    lines = [f"{draw(st.sampled_from(SMOLFILE_KEYS))} = {draw(toml_value)}"
             for _ in range(draw(st.integers(0, 6)))]  # fmt: skip
    for _ in range(draw(st.integers(0, 3))):
        lines.append(f"[{draw(st.sampled_from(SECTIONS))}]")
        keys = ["allow_hosts", "allow_cidrs", "enabled", "pool_size", "volumes", "ports", "exec"]
        lines += [f"{draw(st.sampled_from(keys))} = {draw(toml_value)}"
                  for _ in range(draw(st.integers(0, 3)))]  # fmt: skip
    return "\n".join(lines) + "\n"


def _only_fleet_errors(call, *args):  # type: ignore[no-untyped-def]
    """Runs `call`: fleet's own refusal is an answer; anything else fails the test."""
    with contextlib.suppress(FleetError):
        call(*args)


@SETTINGS
@given(st.one_of(smolfile_text(), st.text(max_size=300)))
def test_the_smolfile_parser_raises_only_fleet_errors(text: str) -> None:
    _only_fleet_errors(parse_smolfile, text, "fuzz.smolfile")


@st.composite
def plan_text(draw: st.DrawFn) -> str:
    out = []
    for _ in range(draw(st.integers(0, 3))):
        out.append("[[steps]]")
        keys = ["argv", "env", "workdir", "timeout_s", "name", "other"]
        out += [f"{draw(st.sampled_from(keys))} = {draw(toml_value)}"
                for _ in range(draw(st.integers(0, 4)))]  # fmt: skip
    if draw(st.booleans()):
        out.append(f"steps = {draw(toml_value)}")
    return "\n".join(out) + "\n"


@SETTINGS
@given(st.one_of(plan_text(), st.text(max_size=300)))
def test_the_plan_loader_raises_only_fleet_errors(text: str) -> None:
    _only_fleet_errors(parse_plan, text, "fuzz.plan")


floats = st.floats(allow_nan=True, allow_infinity=True)
steps = st.builds(
    types_pb2.Step,
    argv=st.lists(nasty, max_size=4),
    env=st.dictionaries(nasty, nasty, max_size=3),
    workdir=nasty,
    timeout_s=floats,
    name=nasty,
)


@st.composite
def submit_requests(draw: st.DrawFn) -> fleet_pb2.SubmitRolloutRequest:
    req = fleet_pb2.SubmitRolloutRequest(
        request_id=draw(nasty),
        idempotency_key=draw(nasty),
        smolfile=draw(st.one_of(smolfile_text(), st.just('image = "minimal"\n'))),
        smolfile_name=draw(nasty),
        steps=draw(st.lists(steps, max_size=3)),
        labels=draw(st.dictionaries(nasty, nasty, max_size=3)),
        tenant=draw(nasty),
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
        outputs=draw(st.lists(nasty, max_size=3)),
    )
    if draw(st.booleans()):
        req.deadline.seconds = draw(st.integers(-(2**63), 2**63 - 1))
        req.deadline.nanos = draw(st.integers(-(2**31), 2**31 - 1))
    req.requirements.isolation = draw(st.integers(-5, 5))
    req.retry.max_attempts = draw(st.integers(0, 2**32 - 1))
    req.retry.initial_backoff_s = draw(floats)
    req.retry.max_backoff_s = draw(floats)
    for _ in range(draw(st.integers(0, 2))):
        req.inputs.add(path=draw(nasty), digest=draw(nasty), size=draw(st.integers(0, 2**40)))
    return req


@SETTINGS
@given(submit_requests())
def test_the_protobuf_conversion_and_checks_raise_only_fleet_errors(
    req: fleet_pb2.SubmitRolloutRequest,
) -> None:
    def convert_and_check() -> None:
        validate_request(convert.submit_from_pb(req), datetime.now(UTC))

    _only_fleet_errors(convert_and_check)
