"""fleet: serve, run agents, submit and watch rollouts, run a Smolfile locally, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from fleet import logs
from fleet.agent.settings import AgentSettings
from fleet.cli.admin import add_commands as add_admin_commands
from fleet.cli.daemons import cmd_agent, cmd_gateway, cmd_serve, cmd_up
from fleet.cli.local import cmd_image, cmd_run
from fleet.cli.rollouts import (
    add_budget_arguments,
    cmd_cancel,
    cmd_egress_events,
    cmd_get,
    cmd_list,
    cmd_submit,
    cmd_watch,
)
from fleet.cli.sessions import add_session_command
from fleet.connect import DEFAULT_SERVER, default_server
from fleet.console.settings import ConsoleSettings
from fleet.core.errors import FleetError, InvalidArgument
from fleet.server.settings import ServeSettings
from gateway.settings import GatewaySettings


async def cmd_top(args: argparse.Namespace) -> int:
    from fleet.cli.top import run_top

    return await run_top(args.metrics, args.gateway_metrics, args.interval_s, args.once)


# -- local -------------------------------------------------------------------------------------


async def cmd_policy(args: argparse.Namespace) -> int:
    from fleet.core import policy

    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as exc:
            raise InvalidArgument(f"{path}: cannot read: {exc}") from exc

    if args.policy_cmd == "explain":
        print("\n".join(policy.explain(read(args.file), args.file)))
        return 0
    if args.policy_cmd == "diff":
        print("\n".join(policy.diff(read(args.old), args.old, read(args.new), args.new)))
        return 0
    org = policy.load_org_policy(args.org_policy) if args.org_policy else None
    findings = [f for path in args.paths for f in policy.audit_text(read(path), path, org)]
    threshold = policy.Severity[args.fail_on.upper()]
    if args.format == "json":
        print(
            json.dumps(
                [f.model_dump(mode="json") | {"severity": str(f.severity)} for f in findings],
                indent=2,
            )
        )
    elif args.format == "sarif":
        print(json.dumps(policy.to_sarif(findings), indent=2))
    else:
        for f in findings:
            where = f"{f.file}:{f.line}" if f.line else f.file
            print(f"{where}: {f.severity} {f.rule} {f.message}")
        print(
            f"{len(findings)} finding{'' if len(findings) == 1 else 's'} in "
            f"{len(args.paths)} file{'' if len(args.paths) == 1 else 's'} "
            f"({len(policy.at_or_above(findings, threshold))} at or above {args.fail_on})"
        )
    return 1 if policy.at_or_above(findings, threshold) else 0


async def cmd_demo(args: argparse.Namespace) -> int:
    from fleet.demo.cli import command

    return await command(args, args.log_level or args.default_log_level)


# -- parser ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleet", description=__doc__)
    p.add_argument(
        "--log-level", default=None, help="debug, info, warning (default depends on command)"
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(
        name: str,
        fn: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
        help_: str,
        log_level: str = "warning",
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(fn=fn, default_log_level=log_level)
        return sp

    def server_flag(sp: argparse.ArgumentParser, *, client_auth: bool = True) -> None:
        sp.add_argument(
            "--server",
            default=default_server(),
            help=f"fleet server host:port (default $FLEET_SERVER or {DEFAULT_SERVER})",
        )
        if not client_auth:
            return
        sp.add_argument(
            "--key", default="",
            help="API key (default $FLEET_KEY, else $FLEET_HOME/admin.key when it exists)",
        )  # fmt: skip
        sp.add_argument(
            "--ca", default="",
            help="the fleet CA's certificate, to verify the server with (default $FLEET_CA, "
            "else $FLEET_HOME/ca/ca.crt when it exists; without one, no TLS)",
        )  # fmt: skip
        sp.add_argument(
            "--plaintext", action="store_true",
            help="no TLS (a server started with --insecure or without a CA)",
        )  # fmt: skip

    sp = add("serve", cmd_serve, "run a fleet server", "info")
    ServeSettings.add_flags(sp)
    ConsoleSettings.add_flags(sp)

    sp = add("agent", cmd_agent, "run a host agent", "info")
    AgentSettings.add_flags(sp)

    sp = add("gateway", cmd_gateway, "run the inference gateway (GPU host)", "info")
    GatewaySettings.add_flags(sp)

    sp = add("up", cmd_up, "server + 1 gpu-class + 2 cpu-class agents, SQLite, one process", "info")
    sp.add_argument("--listen", default=DEFAULT_SERVER)
    sp.add_argument("--db")
    sp.add_argument("--slots", type=int, default=2)
    sp.add_argument(
        "--gateway", action="store_true",
        help="also start the inference gateway (the shipped policy and language model) and "
        "give --inference rollouts its address and a token",
    )  # fmt: skip
    sp.add_argument(
        "--upstream", action="append", default=[], metavar="NAME=URL",
        help="with --gateway: an upstream whose models are served as NAME/MODEL",
    )  # fmt: skip
    sp.add_argument("--upstream-key", action="append", default=[],
                    metavar="NAME=ENV_VAR|NAME=@FILE",
                    help="with --gateway: where upstream NAME's key is read from")  # fmt: skip
    sp.add_argument("--upstreams", metavar="FILE", help="with --gateway: a TOML file of upstreams")
    sp.add_argument(
        "--fallback", action="append", default=[], metavar="MODEL=UPSTREAM/MODEL,...",
        help="with --gateway: the models tried when MODEL's upstream fails",
    )  # fmt: skip

    sp = add("submit", cmd_submit, "submit a rollout")
    server_flag(sp)
    sp.add_argument("-s", "--smolfile", required=True)
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--step", action="append", default=[], help="a step command (repeatable)")
    group.add_argument("--plan", help="TOML plan file with [[steps]]")
    sp.add_argument("--idempotency-key", default=None,
                    help="idempotency key (default: a new one)")  # fmt: skip
    sp.add_argument("--label", action="append", default=[], help="KEY=VALUE (repeatable)")
    sp.add_argument("--deadline-s", type=float, default=None)
    sp.add_argument("--max-attempts", type=int, default=0)
    sp.add_argument("--require-vm", action="store_true", help="never run on namespace isolation")
    sp.add_argument("--require-cuda-device", action="store_true")
    sp.add_argument(
        "--inference", action="store_true",
        help="its steps call the inference gateway: the machine may reach it, and gets "
        "FLEET_GATEWAY and a token for this rollout in FLEET_INFERENCE_TOKEN",
    )  # fmt: skip
    sp.add_argument(
        "--model", action="append", default=[], metavar="UPSTREAM/MODEL",
        help="an upstream model the machine may call through the gateway (UPSTREAM/MODEL, or "
        "UPSTREAM/* for all of one upstream's), besides the gateway's own (repeatable; implies "
        "--inference)",
    )  # fmt: skip
    add_budget_arguments(sp)
    sp.add_argument("--tenant", default="")
    sp.add_argument(
        "--input", action="append", default=[], metavar="SRC:/PATH",
        help="a file or directory uploaded and placed read-only at PATH in the machine before "
        "the first step (repeatable)",
    )  # fmt: skip
    sp.add_argument(
        "--output", action="append", default=[], metavar="/PATH",
        help="a file or directory in the machine collected after the last step (repeatable; "
        "fleet get --download writes them out)",
    )  # fmt: skip
    sp.add_argument("--wait", action="store_true", help="watch until it ends, then print it")
    sp.add_argument("-q", "--quiet", action="store_true", help="print only the rollout id")

    sp = add("watch", cmd_watch, "stream a rollout's events")
    server_flag(sp)
    sp.add_argument("id")
    sp.add_argument("--after", type=int, default=0, help="resume after this sequence number")

    sp = add("get", cmd_get, "show a rollout")
    server_flag(sp)
    sp.add_argument("id")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--download", default="", metavar="DIR",
                    help="write the rollout's outputs into DIR")  # fmt: skip

    sp = add("list", cmd_list, "list rollouts, newest first")
    server_flag(sp)
    sp.add_argument("--label", action="append", default=[])
    sp.add_argument("--page-size", type=int, default=50)
    sp.add_argument("--page-token", default="")
    sp.add_argument(
        "--could-reach",
        default="",
        metavar="HOST",
        help="only rollouts whose machine's effective egress allowed HOST (for review)",
    )

    sp = add("cancel", cmd_cancel, "cancel a rollout")
    server_flag(sp)
    sp.add_argument("id")
    sp.add_argument("--reason", default="")

    sp = add("top", cmd_top, "live metrics of a server and its gateway")
    sp.add_argument("--metrics", default="http://127.0.0.1:9464/metrics",
                    help="the server's metrics URL (fleet serve --metrics-listen)")  # fmt: skip
    sp.add_argument("--gateway-metrics", default="http://127.0.0.1:50053/metrics",
                    help="the gateway's metrics URL (its HTTP endpoint)")  # fmt: skip
    sp.add_argument("--interval-s", type=float, default=1.0)
    sp.add_argument("--once", action="store_true", help="print once and exit")

    sp = add("egress-events", cmd_egress_events, "list what a rollout's machines were refused")
    server_flag(sp)
    sp.add_argument("rollout_id")
    sp.add_argument("--json", action="store_true", help="one JSON object per line")

    sp = add("run", cmd_run, "run one command in one machine from a Smolfile, locally")
    sp.add_argument("-s", "--smolfile", required=True)
    sp.add_argument("--runtime", choices=["auto", "smol", "namespace"], default="auto")
    sp.add_argument("--timeout-s", type=float, default=3600.0)
    sp.add_argument("command", nargs=argparse.REMAINDER)

    sp = add("image", cmd_image, "build and list images", "info")
    isub = sp.add_subparsers(dest="image_cmd", required=True)
    b = isub.add_parser("build", help="build an image from images/NAME/recipe.toml (cached)")
    b.add_argument("name")
    b.add_argument("--force", action="store_true")
    b.add_argument("--quiet", action="store_true", help="say nothing when it was cached")
    isub.add_parser("list", help="list stored images")
    i = isub.add_parser("inspect", help="digest, size, recipe, created time")
    i.add_argument("name")
    r = isub.add_parser("rm", help="remove an image (its archive too if nothing else names it)")
    r.add_argument("name")
    u = isub.add_parser("push", help="push an image to an OCI registry ($FLEET_REGISTRY_AUTH)")
    u.add_argument("name", help="a stored image's name or sha256:… digest")
    u.add_argument("--registry", required=True, help="[https://]HOST[:PORT]/REPO")
    u.add_argument("--tag", default="", help="default: the image's name")
    u.add_argument("--ca", default="", help="a CA to trust besides the system's (fleet's own)")
    u = isub.add_parser("pull", help="pull an image from an OCI registry ($FLEET_REGISTRY_AUTH)")
    u.add_argument("ref", help="[https://]HOST[:PORT]/REPO[:TAG|@sha256:…]")
    u.add_argument("--name", default="", help="store name (default: the tag)")
    u.add_argument("--ca", default="", help="a CA to trust besides the system's (fleet's own)")
    k = isub.add_parser("pack", help="pack an image into a .smolmachine (microVM hosts)")
    k.add_argument("name")
    k.add_argument("--out", default="", help="default: NAME-DIGEST.smolmachine here")

    sp = add("policy", cmd_policy, "audit, explain and diff Smolfiles' egress policy")
    psub = sp.add_subparsers(dest="policy_cmd", required=True)
    a = psub.add_parser("audit", help="findings with file, line, rule, severity")
    a.add_argument("paths", nargs="+")
    a.add_argument("--org-policy", help="the organisation's policy (TOML)")
    a.add_argument("--format", choices=["text", "json", "sarif"], default="text")
    a.add_argument(
        "--fail-on",
        choices=["low", "medium", "high"],
        default="high",
        help="exit 1 when a finding is at or above this severity (default high)",
    )
    e = psub.add_parser("explain", help="the effective egress policy in plain words")
    e.add_argument("file")
    d = psub.add_parser("diff", help="the egress a change adds and removes")
    d.add_argument("old")
    d.add_argument("new")

    add_admin_commands(add)
    add_session_command(sub, server_flag)

    sp = add("demo", cmd_demo, "evaluate the shipped suite on an embedded fleet", "error")
    from fleet.demo.cli import add_arguments

    add_arguments(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs one command; a refusal (fleet's own error, whoever raised it) is printed with its
    code, and a retry hint where it has one, and exits 2. Anything else is a bug and keeps its
    traceback."""
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level or args.default_log_level)
    try:
        code: int = asyncio.run(args.fn(args))
        return code
    except FleetError as exc:
        hint = f" (retry after {exc.retry_after_s:g}s)" if exc.retry_after_s is not None else ""
        print(f"fleet {args.cmd}: {exc.code}: {exc.message}{hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # (`fleet policy explain F | head`): the reader left; say nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
