"""Server replicas that agents and clients move between: two replicas on one PostgreSQL ledger,
each in a process of its own, agents and a client given both addresses. The replica they use is
killed (SIGKILL) while rollouts run: the agents renew their leases, report their attempts and
claim more on the other, the client's watches resume there from their last event, and every
rollout ends exactly once, each step run once. Also, without a kill: an address that answers
nothing first in the list costs a client or an agent nothing but a move."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import sys
import unittest.mock
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

import pytest

import fleet.agent.agent
from fleet.agent.agent import Agent
from fleet.agent.config import AgentConfig
from fleet.agent.link import Link
from fleet.client import AsyncFleet
from fleet.client.models import Event, Smolfile
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.runtime.base import ExecResult
from fleet.testing import FakeRuntime
from tests.integration.harness import NAMESPACE, harness, registered
from tests.pgserver import create_database, drop_database

REPO = Path(__file__).resolve().parents[2]
LEASE_TTL_S = 4.0
STEP_S = 1.5
ROLLOUTS = 8
SMOLFILE = Smolfile.from_text('image = "minimal"\n')
DEAD = "127.0.0.1:1"
"""An address nothing listens on (port 1 is never a fleet server's)."""


@contextlib.asynccontextmanager
async def replica(url: str, images: ImageStore, tmp: Path) -> AsyncIterator[tuple[int, str]]:
    """A server replica in a process of its own on the ledger at `url`: (its pid, address).
    Its output goes to a file in `tmp` (a pipe nobody reads would stall it once full)."""
    out = tmp / f"replica-{uuid.uuid4().hex[:8]}.log"
    with out.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.replica_server", url, str(images.root),
            str(images.recipes), str(LEASE_TTL_S), cwd=REPO, stdout=sink, stderr=sink,
        )  # fmt: skip
    try:
        for _ in range(1200):  # (60 s)
            ready = [w for w in out.read_text().split("\n") if w.startswith("ready ")]
            if ready or proc.returncode is not None:
                break
            await asyncio.sleep(0.05)
        assert ready, f"the replica did not start: {out.read_text()[-2000:]}"
        yield proc.pid, f"127.0.0.1:{int(ready[0].split()[1])}"
    finally:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), 30)


async def until(what: str, check: Callable[[], Awaitable[bool]]) -> None:
    for _ in range(1200):  # (60 s)
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not in 60 s: {what}")


class Counted(FakeRuntime):
    """The in-memory runtime, whose `run TOKEN` steps take STEP_S and are counted by token
    (in `runs`, shared by every host's runtime)."""

    def __init__(self, runs: collections.Counter[str]) -> None:
        super().__init__(self._answer)
        self.runs = runs

    async def _answer(self, argv: list[str], env: Mapping[str, str]) -> ExecResult:
        if argv[:1] == ["run"]:
            self.runs[argv[1]] += 1
            await asyncio.sleep(STEP_S)
        return ExecResult(exit_code=0)


def agent(
    tmp: Path, images: ImageStore, host_id: str, servers: str, runs: collections.Counter[str]
) -> Agent:
    config = AgentConfig(
        server=servers, host_id=host_id, host_class=HostClass.CPU, runtime=NAMESPACE,
        machines_dir=tmp / host_id / "machines", images=images, slots=2, claim_wait_s=1.0,
        drain_deadline_s=5.0,
    )  # fmt: skip
    runtime = Counted(runs)
    with unittest.mock.patch.object(fleet.agent.agent, "make_runtime", lambda *_: runtime):
        return Agent(config)


async def hosts(client: AsyncFleet, count: int) -> bool:
    return len(await client.admin.hosts()) >= count


def running(runs: collections.Counter[str]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(runs)

    return check


async def watched(client: AsyncFleet, rollout_id: str, into: list[Event]) -> None:
    async for event in client.watch(rollout_id):
        into.append(event)


async def test_killing_the_replica_in_use_loses_no_rollout_and_runs_none_twice(
    tmp_path: Path, images: ImageStore, postgres: str
) -> None:
    url = create_database(postgres)
    runs: collections.Counter[str] = collections.Counter()
    stop = asyncio.Event()
    try:
        async with (
            replica(url, images, tmp_path) as (pid_a, a),
            replica(url, images, tmp_path) as (_, b),
        ):
            servers = f"{a},{b}"  # (everyone starts on a)
            agents = [agent(tmp_path, images, f"host-{i}", servers, runs) for i in range(2)]
            tasks = [asyncio.create_task(x.run(stop)) for x in agents]
            async with AsyncFleet(servers, plaintext=True) as client:
                async with asyncio.timeout(120):
                    await until("both hosts registered", lambda: hosts(client, 2))
                    tokens = [uuid.uuid4().hex for _ in range(ROLLOUTS)]
                    ids = [
                        (await client.submit(SMOLFILE, [["run", t]], max_attempts=3)).id
                        for t in tokens
                    ]
                    events: dict[str, list[Event]] = {i: [] for i in ids}
                    watches = [asyncio.create_task(watched(client, i, events[i])) for i in ids]
                    await until("work running on the hosts, through a", running(runs))
                    assert sum(runs.values()) < ROLLOUTS
                    os.kill(pid_a, signal.SIGKILL)
                    await asyncio.gather(*watches)
                    done = [await client.get(i) for i in ids]
                    # Every event of each rollout, read afresh from b.
                    history = {i: [e async for e in client.watch(i)] for i in ids}
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        stop.set()
        drop_database(postgres, url)

    assert [r.state for r in done] == ["SUCCEEDED"] * ROLLOUTS, [(r.id, r.error) for r in done]
    assert [r.attempts for r in done] == [1] * ROLLOUTS  # none claimed again
    assert [len(r.attempt_history) for r in done] == [1] * ROLLOUTS
    assert [runs[t] for t in tokens] == [1] * ROLLOUTS  # each step ran once
    for rollout_id in ids:
        # (Sequences are the ledger's, across rollouts: each rollout's rise, with gaps.)
        seen = [e.sequence for e in events[rollout_id]]
        assert seen == sorted(set(seen)), f"{rollout_id}: {seen}"  # in order, none twice
        assert seen == [e.sequence for e in history[rollout_id]]  # none missed
        assert events[rollout_id][-1].final
    assert client.replicas.moves >= 1 and client.replicas.current == b
    for x in agents:
        link = x.stub
        assert isinstance(link, Link) and link.replicas.moves >= 1 and link.server == b


async def test_a_client_and_an_agent_move_past_a_replica_that_answers_nothing(
    tmp_path: Path, images: ImageStore
) -> None:
    runs: collections.Counter[str] = collections.Counter()
    async with harness(tmp_path, images) as h:
        servers = f"{DEAD},{h.server.address}"
        stop = asyncio.Event()
        host = agent(tmp_path, images, "host-0", servers, runs)
        task = asyncio.create_task(host.run(stop))
        try:
            await registered(h.server, "host-0")
            async with AsyncFleet(servers, plaintext=True) as client:
                submitted = await client.submit(SMOLFILE, [["run", "once"]])
                done = await client.wait(submitted.id, timeout_s=60)
                assert client.replicas.current == h.server.address
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
    assert done.state == "SUCCEEDED" and done.host_id == "host-0"
    assert runs == {"once": 1}
    assert isinstance(host.stub, Link) and host.stub.server == h.server.address


@pytest.mark.parametrize("bad", [" , ", "127.0.0.1", "127.0.0.1:0", "a:1,http://b:2", "::1:5"])
def test_a_server_list_that_is_not_addresses_is_refused_naming_the_address(bad: str) -> None:
    from fleet.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="server"):
        AsyncFleet(bad, plaintext=True)
