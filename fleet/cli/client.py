"""What the command line reads from files and flags to talk to a server: plans, labels, inputs,
and the connection itself (`fleet.client.AsyncFleet`, the one way in)."""

from __future__ import annotations

import argparse
import shlex
import tomllib
from pathlib import Path
from typing import Any

from fleet.client import AsyncFleet, Step, transfer, wire
from fleet.core.errors import InvalidArgument

PLAN_KEYS = {"argv", "env", "workdir", "timeout_s", "name"}


def connect(args: argparse.Namespace) -> AsyncFleet:
    """The client for a command's --server, --key, --ca and --plaintext: one channel, opened
    on its first call, for everything the command asks the server."""
    return AsyncFleet(
        args.server, key=args.key or None, ca=args.ca or None, plaintext=args.plaintext
    )


def load_plan(path: str) -> list[Step]:
    """A plan file: TOML with [[steps]] tables (argv, env, workdir, timeout_s, name)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: cannot read plan: {exc}") from exc
    return parse_plan(text, path)


def parse_plan(text: str, path: str = "<plan>") -> list[Step]:
    """A plan's text as steps; anything else is refused with InvalidArgument saying where."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path}: cannot read plan: {exc}") from exc
    except RecursionError:
        raise InvalidArgument(f"{path}: cannot read plan: nested too deeply") from None
    steps = data.get("steps")
    unknown = set(data) - {"steps"}
    if unknown:
        raise InvalidArgument(f"{path}: unknown plan keys {sorted(unknown)[:10]}")
    if not isinstance(steps, list) or not steps:
        raise InvalidArgument(f"{path}: a plan needs at least one [[steps]] table")
    out = []
    for index, step in enumerate(steps):
        where = f"{path}: steps[{index}]"
        if not isinstance(step, dict):
            raise InvalidArgument(f"{where} must be a table")
        bad = set(step) - PLAN_KEYS
        if bad:
            raise InvalidArgument(f"{where}: unknown keys {sorted(bad)[:10]}")
        argv = step.get("argv")
        if isinstance(argv, str):
            try:
                argv = shlex.split(argv)
            except ValueError as exc:
                raise InvalidArgument(f"{where}.argv: {exc}") from None
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise InvalidArgument(f"{where}.argv must be a list of strings")
        env = step.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(v, str | int | float | bool) for v in env.values()
        ):
            raise InvalidArgument(f"{where}.env must be a table of strings")
        workdir, name = step.get("workdir", ""), step.get("name", "")
        if not isinstance(workdir, str) or not isinstance(name, str):
            raise InvalidArgument(f"{where}: workdir and name must be strings")
        timeout = step.get("timeout_s", 0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise InvalidArgument(f"{where}.timeout_s must be a number of seconds")
        try:
            timeout_s = float(timeout)
        except OverflowError:
            raise InvalidArgument(f"{where}.timeout_s is out of range") from None
        planned = Step(argv=argv, env={str(k): str(v) for k, v in env.items()},
                       workdir=workdir, timeout_s=timeout_s, name=name)  # fmt: skip
        wire.step(planned, index)  # (refused here, naming the step, if the wire cannot hold it)
        out.append(planned)
    return out


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"label {item!r} is not KEY=VALUE")
        labels[key] = value
    return labels


def steps_from_flags(step_flags: list[str]) -> list[Step]:
    steps = []
    for index, flag in enumerate(step_flags):
        try:
            argv = shlex.split(flag)
        except ValueError as exc:
            raise InvalidArgument(f"--step {flag!r}: {exc}") from None
        steps.append(Step(argv=argv, name=f"step-{index}"))
    return steps


def parse_input(spec: str) -> tuple[Path, str, bool]:
    """`SRC:/path/in/machine` -> (SRC, path, SRC is a directory); SRC may itself hold ':'
    (split at the last)."""
    src, sep, dest = spec.rpartition(":")
    if not sep or not src or not dest.startswith("/"):
        raise InvalidArgument(f"--input {spec!r}: expected SRC:/absolute/path/in/machine")
    path = Path(src)
    if not path.exists():
        raise InvalidArgument(f"--input {spec!r}: {src} does not exist")
    return path, dest, path.is_dir()


def parse_inputs(specs: list[str]) -> dict[str, Path]:
    """--input flags as the client takes them: path in the machine -> local source; two for
    one path are refused (one would be lost)."""
    inputs: dict[str, Path] = {}
    for spec in specs:
        src, dest, _ = parse_input(spec)
        if dest in inputs:
            raise InvalidArgument(f"--input {spec!r}: {dest} is given twice")
        inputs[dest] = src
    return inputs


# -- for code that holds a raw FleetService stub -----------------------------------------------


async def upload(stub: Any, src: Path, dest: str, directory: bool) -> Any:
    """`AsyncFleet.upload` for a caller holding a raw stub: the input as the wire's
    InputFile, gRPC's own errors let through."""
    return wire.input_file_pb(await transfer.upload(stub, src, dest, directory))


async def download(stub: Any, rollout: Any, into: Path) -> list[str]:
    """`AsyncFleet.download_outputs` for a caller holding a raw stub and a wire Rollout."""
    done = wire.rollout(rollout)
    return await transfer.download_outputs(stub, done.id, done.outputs, into)
