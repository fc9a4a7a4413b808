"""`fleet submit`, `watch`, `get`, `list`, `cancel` and `egress-events`: a server's rollouts,
through `fleet.client` (one channel per command)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

from fleet.cli.client import (
    connect,
    load_plan,
    parse_inputs,
    parse_labels,
    steps_from_flags,
)
from fleet.client import AsyncFleet, Event, Rollout, Smolfile
from fleet.core.manifest import BUDGETS, MAX_TOKEN_BUDGET


def _token_count(text: str) -> int:
    """A budget flag's value: a whole number of tokens from 0 (no budget) up."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of tokens, not {text!r}"
        ) from None
    if not 0 <= value <= MAX_TOKEN_BUDGET:
        raise argparse.ArgumentTypeError(
            f"{value} is out of range: from 0 (no budget) to {MAX_TOKEN_BUDGET}"
        )
    return value


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """`--max-prompt-tokens` and `--max-completion-tokens`, for `fleet submit` and `fleet
    session open` alike: a rollout's token budgets over all its model calls (imply
    --inference)."""
    for name, what in zip(BUDGETS, ("prompt", "completion"), strict=True):
        parser.add_argument(
            "--" + name.replace("_", "-"), type=_token_count, default=0, metavar="N",
            help=f"{what} tokens its model calls through the gateway may take in all, its own "
            f"model's and upstream ones' (0: no budget; implies --inference)",
        )  # fmt: skip


def budgets_of(args: argparse.Namespace) -> dict[str, int]:
    """The budgets the command line set (none where its parser has no budget flags)."""
    return {name: int(getattr(args, name, 0) or 0) for name in BUDGETS}


def _clock(at: datetime | None, fmt: str = "%H:%M:%S") -> str:
    return at.strftime(fmt) if at is not None else "-"


def print_rollout(r: Rollout, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r.wire_json(), indent=2))
        return
    print(f"rollout   {r.id}")
    print(f"state     {r.state}")
    print(f"class     {r.host_class or 'unspecified'}")
    print(f"attempts  {r.attempts}")
    if r.host_id:
        print(f"served by {r.host_id} (runtime {r.runtime or 'unspecified'}, device {r.device})")
    if r.error:
        print(f"error     {r.error}")
    if r.egress is not None:
        e = r.egress
        allowed = ", ".join([*e.allow_hosts, *e.allow_cidrs])
        print(f"egress    {e.mode or 'unspecified'}{': ' + allowed if allowed else ''} "
              f"({e.enforced_by})")  # fmt: skip
    for a in r.attempt_history:
        ended = _clock(a.ended_at) if a.ended_at is not None else "running"
        print(
            f"attempt {a.attempt} on {a.host_id}: {_clock(a.started_at)} -> {ended} "
            f"{a.outcome} {a.error}".rstrip()
        )
    for o in r.outputs:
        what = "directory (tar)" if o.directory else "file"
        if o.digest:
            note = f" ({o.error})" if o.error else ""  # e.g. a step's log cut at its bound
            print(f"output    {o.path}: {what}, {o.size} bytes, {o.digest}{note}")
        else:
            print(f"output    {o.path}: not stored: {o.error}")
    for s in r.results:
        flag = " (timed out)" if s.timed_out else ""
        print(f"-- step {s.index} {s.name}: exit {s.exit_code}{flag}, {s.duration_s:.3f}s")
        if s.stdout:
            print(s.stdout.decode(errors="replace").rstrip())
        if s.stderr:
            print("[stderr] " + s.stderr.decode(errors="replace").rstrip())


def print_event(e: Event) -> None:
    move = f"{e.from_state or '-'} -> {e.state}" if e.state else ""
    print(
        f"#{e.sequence:<6} {_clock(e.at)} {e.kind:<18} {move:<22} {e.actor} {e.message}".rstrip(),
        flush=True,
    )


async def watch(fleet: AsyncFleet, rollout_id: str, after: int) -> None:
    """Prints the rollout's events until it is final (the client resumes a dropped stream)."""
    async for event in fleet.watch(rollout_id, after):
        print_event(event)


async def cmd_submit(args: argparse.Namespace) -> int:
    smolfile = Smolfile.load(args.smolfile)  # read and checked once, here, with file and line
    steps = load_plan(args.plan) if args.plan else steps_from_flags(args.step)
    if smolfile.parsed.spec.dev is not None:
        print(
            f"fleet submit: {args.smolfile}'s [dev] section is for local runs (fleet run) and "
            "is ignored here; send data with --input SRC:/path",
            file=sys.stderr,
        )
    inputs = parse_inputs(args.input)
    budgets = budgets_of(args)
    async with connect(args) as fleet:
        rollout = await fleet.submit(
            smolfile, steps, inputs=inputs, outputs=args.output,
            idempotency_key=args.idempotency_key, labels=parse_labels(args.label),
            deadline_s=args.deadline_s, max_attempts=args.max_attempts,
            require_vm=args.require_vm, require_cuda_device=args.require_cuda_device,
            inference=args.inference or bool(args.model) or any(budgets.values()),
            tenant=args.tenant, models=args.model, max_prompt_tokens=budgets["max_prompt_tokens"],
            max_completion_tokens=budgets["max_completion_tokens"],
        )  # fmt: skip
        said = "submitted" if rollout.created else "already submitted (same key)"
        print(rollout.id if args.quiet else f"{rollout.id} {said}", flush=True)
        if not args.wait:
            return 0
        await watch(fleet, rollout.id, 0)
        final = await fleet.get(rollout.id)
    print_rollout(final, False)
    return 0 if final.state == "SUCCEEDED" else 1


async def cmd_watch(args: argparse.Namespace) -> int:
    async with connect(args) as fleet:
        await watch(fleet, args.id, args.after)
    return 0


async def cmd_get(args: argparse.Namespace) -> int:
    async with connect(args) as fleet:
        rollout = await fleet.get(args.id)
        print_rollout(rollout, args.json)
        if args.download:
            written = await fleet.download_outputs(rollout, Path(args.download))
            print(f"downloaded {len(written)} outputs to {args.download}", file=sys.stderr)
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    async with connect(args) as fleet:
        page = await fleet.list_page(
            parse_labels(args.label), could_reach=args.could_reach,
            page_size=args.page_size, page_token=args.page_token,
        )  # fmt: skip
    for r in page.rollouts:
        labels = ",".join(f"{k}={v}" for k, v in sorted(r.labels.items()))
        print(f"{r.id}  {r.state:<10} attempts={r.attempts} {labels}")
    if page.next_page_token:
        print(f"next page: --page-token {page.next_page_token}")
    return 0


async def cmd_cancel(args: argparse.Namespace) -> int:
    async with connect(args) as fleet:
        r = await fleet.cancel(args.id, args.reason)
    print(f"{r.id} {r.state}" + (" (stop requested)" if r.state == "RUNNING" else ""))
    return 0


async def cmd_egress_events(args: argparse.Namespace) -> int:
    """What a rollout's machines were refused: DNS queries and connections, oldest first."""
    async with connect(args) as fleet:
        events = await fleet.egress_events(args.rollout_id)
    if args.json:
        for e in events:
            print(json.dumps({
                "rollout_id": e.rollout_id, "attempt": e.attempt, "machine": e.machine,
                "at": e.at.isoformat() if e.at is not None else "", "kind": e.kind,
                "destination": e.destination, "decision": e.decision, "reason": e.reason,
            }))  # fmt: skip
        return 0
    if not events:
        print(f"{args.rollout_id}: no refused DNS queries or connections")
        return 0
    print(f"{'time (UTC)':<24} {'try':>3}  {'kind':<7}  {'destination':<40}  reason")
    for e in events:
        when = _clock(e.at, "%Y-%m-%d %H:%M:%S.%f")[:23]
        print(f"{when:<24} {e.attempt:>3}  {e.kind:<7}  {e.destination:<40}  {e.reason}")
    return 0
