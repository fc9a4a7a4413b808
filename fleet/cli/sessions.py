"""`fleet session ...`: interactive sessions from the shell, through `fleet.client`.

fleet session open -s SMOLFILE            prints the session id
fleet session exec ID -- CMD [ARG...]     runs it; its output streams; exits with its code
fleet session cp SRC ID:PATH | [-r] ID:PATH DST   (a local directory goes whole)
fleet session fork ID [-n N]               prints the ids of N copies of it (parked ones too)
fleet session park ID                      stores its disk and frees its machine
fleet session resume ID                    opens a parked session again, on any host
fleet session close ID
fleet session list
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from fleet.cli.client import connect
from fleet.cli.rollouts import add_budget_arguments, budgets_of
from fleet.client import AsyncFleet
from fleet.core.errors import InvalidArgument


async def cmd_session(args: argparse.Namespace) -> int:
    async with connect(args) as fleet:
        return await _session(fleet, args)


async def _session(fleet: AsyncFleet, args: argparse.Namespace) -> int:
    if args.action == "open":
        budgets = budgets_of(args)
        box = await fleet.session(
            args.smolfile, idle_timeout_s=args.idle_timeout_s,
            max_lifetime_s=args.max_lifetime_s, require_vm=args.require_vm,
            inference=args.inference or bool(args.model) or any(budgets.values()),
            models=args.model, max_prompt_tokens=budgets["max_prompt_tokens"],
            max_completion_tokens=budgets["max_completion_tokens"], on_idle=args.on_idle,
        )  # fmt: skip
        print(box.id)
        return 0
    if args.action == "park":
        parked = await fleet.attach(args.id).park()
        print(f"{parked.id} {parked.state}")
        return 0
    if args.action == "resume":
        box = await fleet.attach(args.id).resume(ready_timeout_s=args.ready_timeout_s)
        print(f"{box.id} OPEN {box.host_id}")
        return 0
    if args.action == "list":
        for session_id, state, host in await fleet.sessions():
            print(f"{session_id}  {state:<7} {host}")
        return 0
    if args.action == "fork":
        for fork in await fleet.attach(args.id).fork(args.count):
            print(fork.id)
        return 0
    if args.action == "close":
        print(f"{args.id} {await fleet.attach(args.id).close()}")
        return 0
    if args.action == "exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise InvalidArgument("fleet session exec ID -- COMMAND [ARG...]")

        def show(stream: str, chunk: bytes) -> None:
            out = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
            out.write(chunk)
            out.flush()

        stdin = await asyncio.to_thread(sys.stdin.buffer.read) if args.stdin else b""
        result = await fleet.attach(args.id).exec(
            command, timeout_s=args.timeout_s, on_output=show, stdin=stdin
        )
        if result.timed_out:
            print(f"fleet session exec: timed out after {args.timeout_s:g} s", file=sys.stderr)
        return result.exit_code if 0 <= result.exit_code < 256 else 124
    # cp
    src, dst = args.src, args.dst
    if ":/" in dst and ":/" not in src:
        session_id, _, path = dst.partition(":")
        box = fleet.attach(session_id)
        if await asyncio.to_thread(Path(src).is_dir):  # (as one tar archive, unpacked in PATH)
            size = await box.upload_dir(src, path)
        else:
            size = await box.write_file(path, await asyncio.to_thread(Path(src).read_bytes))
        print(f"{size} bytes -> {session_id}:{path}", file=sys.stderr)
        return 0
    if ":/" in src and ":/" not in dst:
        session_id, _, path = src.partition(":")
        box = fleet.attach(session_id)
        if args.recursive:
            names = await box.download_dir(path, dst)
            print(f"{session_id}:{path} -> {dst} ({len(names)} entries)", file=sys.stderr)
            return 0
        data = await box.read_file(path)
        await asyncio.to_thread(Path(dst).write_bytes, data)
        print(f"{session_id}:{path} -> {dst} ({len(data)} bytes)", file=sys.stderr)
        return 0
    raise InvalidArgument("fleet session cp: one side is a local file, the other ID:/PATH")


def add_session_command(sub: argparse._SubParsersAction, server_flag: object) -> None:  # type: ignore[type-arg]
    sp = sub.add_parser(
        "session", help="interactive sessions: open, exec, cp, fork, park, resume, close, list"
    )
    sp.set_defaults(fn=cmd_session, default_log_level="warning")
    ssub = sp.add_subparsers(dest="action", required=True)
    o = ssub.add_parser("open", help="open a session and print its id")
    o.add_argument("-s", "--smolfile", required=True)
    o.add_argument("--idle-timeout-s", type=float, default=600.0)
    o.add_argument("--on-idle", choices=("park", "close"), default="park",
                   help="what it does once idle for --idle-timeout-s: park (its disk kept, "
                   "`fleet session resume` reopens it; the default) or close")  # fmt: skip
    o.add_argument("--max-lifetime-s", type=float, default=3600.0)
    o.add_argument("--require-vm", action="store_true")
    o.add_argument(
        "--inference",
        action="store_true",
        help="its machine calls the inference gateway, with a token of its own",
    )
    o.add_argument("--model", action="append", default=[], metavar="UPSTREAM/MODEL",
                   help="an upstream model its machine may call through the gateway, besides "
                   "the gateway's own (repeatable; implies --inference)")  # fmt: skip
    add_budget_arguments(o)
    e = ssub.add_parser("exec", help="run a command in a session (exit code passed through)")
    e.add_argument("id")
    e.add_argument("--timeout-s", type=float, default=600.0)
    e.add_argument("--stdin", action="store_true", help="send this process's stdin")
    e.add_argument("command", nargs=argparse.REMAINDER)
    c = ssub.add_parser(
        "cp", help="copy SRC ID:/PATH into a session (a directory whole), or ID:/PATH DST out"
    )
    c.add_argument("-r", "--recursive", action="store_true", help="ID:/PATH is a directory")
    c.add_argument("src")
    c.add_argument("dst")
    f = ssub.add_parser("fork", help="copies of a session's machine as it is now (new ids)")
    f.add_argument("id")
    f.add_argument("-n", "--count", type=int, default=1)
    pk = ssub.add_parser(
        "park", help="store a session's disk and free its machine (no process carries over)"
    )
    pk.add_argument("id")
    r = ssub.add_parser("resume", help="open a parked session again, on any host of its class")
    r.add_argument("id")
    r.add_argument("--ready-timeout-s", type=float, default=300.0)
    x = ssub.add_parser("close", help="close a session")
    x.add_argument("id")
    ssub.add_parser("list", help="sessions the key may see")
    for parser in (o, e, c, f, pk, r, x, *ssub.choices.values()):
        if "--server" not in parser._option_string_actions:
            server_flag(parser)  # type: ignore[operator]
