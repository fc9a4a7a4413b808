"""fleet.client as the one way in: a watch that outlives a dropped connection, a wait that
watches instead of polling, refusals as fleet's own errors, and `fleet submit` reading its
Smolfile once and opening one connection, all against a real server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.client import AsyncFleet, Fleet
from fleet.core import smolfile as smolfile_module
from fleet.core.errors import FleetError, NotFound, ResourceExhausted, Unavailable
from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from fleet.server.app import ServerConfig
from fleet.server.fleet_service import FleetServicer
from tests.integration.harness import SECRET, Harness, harness, namespace_runtime

MINIMAL = 'image = "minimal"\n'


class Proxy:
    """A TCP relay on loopback in front of a server: counts the connections made through it
    and can cut every one of them at once, as a restarting server or a load balancer would."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.connections = 0
        self._open: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._open += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        """Drops every connection open through the proxy (a reset, not a goodbye)."""
        for writer in self._open:
            writer.transport.abort()
        self._open.clear()

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@contextlib.asynccontextmanager
async def proxied(upstream: str) -> AsyncIterator[Proxy]:
    proxy = Proxy(upstream)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


@contextlib.asynccontextmanager
async def fleet_with_a_host(
    tmp_path: Path, images: ImageStore, config: ServerConfig | None = None
) -> AsyncIterator[Harness]:
    """A server with one cpu host registered by hand (no agent: rollouts stay queued until
    the test moves them)."""
    async with harness(tmp_path, images, config) as h:
        await h.register_host("cpu-h1")
        yield h


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Counts GetRollout calls at the server, and says when a WatchRollout call arrives."""
    seen: dict[str, Any] = {"get": 0, "watching": asyncio.Event()}
    get, watch = FleetServicer.GetRollout, FleetServicer.WatchRollout

    async def counted_get(self: Any, request: Any, context: Any) -> Any:
        seen["get"] += 1
        return await get(self, request, context)

    async def noted_watch(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
        seen["watching"].set()
        async for event in watch(self, request, context):
            yield event

    monkeypatch.setattr(FleetServicer, "GetRollout", counted_get)
    monkeypatch.setattr(FleetServicer, "WatchRollout", noted_watch)
    yield seen


async def test_a_watch_resumes_after_the_connection_drops(
    tmp_path: Path, images: ImageStore
) -> None:
    """The connection under a watch is cut after its first event: the watch reconnects and
    goes on after the last event it saw, so every event arrives once, in order, to the end."""
    async with (
        fleet_with_a_host(tmp_path, images) as h,
        proxied(h.server.address) as proxy,
        AsyncFleet(proxy.address, plaintext=True) as through_proxy,
        AsyncFleet(h.server.address, plaintext=True) as direct,
    ):
        rollout = await direct.submit(_smolfile(tmp_path), ["true"])
        events = through_proxy.watch(rollout.id)
        first = await asyncio.wait_for(anext(events), 30)
        proxy.cut()
        await direct.cancel(rollout.id, "the test ends it")
        rest = [e async for e in events]
        expected = [e.sequence async for e in direct.watch(rollout.id)]

    assert first.kind == "submitted"
    assert [first.sequence, *(e.sequence for e in rest)] == expected
    assert rest[-1].state == "CANCELLED" and rest[-1].final
    assert proxy.connections >= 2  # (the watch did reconnect)


def _smolfile(tmp_path: Path, text: str = MINIMAL) -> Path:
    path = tmp_path / "task.smolfile"
    path.write_text(text)
    return path


async def test_wait_returns_on_the_final_event_without_polling(
    tmp_path: Path, images: ImageStore, calls: dict[str, Any]
) -> None:
    """`wait` watches the rollout's events and reads it once, when an event ends it."""
    async with (
        fleet_with_a_host(tmp_path, images) as h,
        AsyncFleet(h.server.address, plaintext=True) as fleet,
    ):
        rollout = await fleet.submit(_smolfile(tmp_path), ["true"])
        waiting = asyncio.create_task(fleet.wait(rollout.id, timeout_s=60))
        await asyncio.wait_for(calls["watching"].wait(), 30)
        gets_while_waiting = calls["get"]
        await fleet.cancel(rollout.id)
        done = await asyncio.wait_for(waiting, 30)

    assert gets_while_waiting == 0
    assert done.state == "CANCELLED" and done.final
    assert calls["get"] == 1


async def test_the_blocking_client_waits_and_watches_the_same_way(
    tmp_path: Path, images: ImageStore, calls: dict[str, Any]
) -> None:
    """`Fleet` runs the async client's code: its wait watches, then reads the rollout once;
    its watch ends with the final event."""
    async with (
        fleet_with_a_host(tmp_path, images) as h,
        AsyncFleet(h.server.address, plaintext=True) as direct,
    ):
        rollout = await direct.submit(_smolfile(tmp_path), ["true"])
        fleet = Fleet(h.server.address, plaintext=True)
        try:
            waiting = asyncio.create_task(asyncio.to_thread(fleet.wait, rollout.id, 60))
            await asyncio.wait_for(calls["watching"].wait(), 30)
            gets_while_waiting = calls["get"]
            await direct.cancel(rollout.id)
            final = await asyncio.wait_for(waiting, 30)
            states = await asyncio.to_thread(lambda: [e.state for e in fleet.watch(rollout.id)])
        finally:
            await asyncio.to_thread(fleet.close)

    assert gets_while_waiting == 0 and calls["get"] == 1
    assert final.state == "CANCELLED" and states[-1] == "CANCELLED"


async def test_refusals_are_fleets_own_errors_with_codes_and_retry_hints(
    tmp_path: Path, images: ImageStore
) -> None:
    config = ServerConfig(lease_ttl_s=5.0, heartbeat_interval_s=0.5, token_secret=SECRET,
                          max_active_per_tenant=1)  # fmt: skip
    async with (
        fleet_with_a_host(tmp_path, images, config) as h,
        AsyncFleet(h.server.address, plaintext=True) as fleet,
        AsyncFleet("127.0.0.1:1", plaintext=True) as nowhere,
    ):
        await fleet.submit(_smolfile(tmp_path), ["true"])
        with pytest.raises(ResourceExhausted) as over:
            await fleet.submit(_smolfile(tmp_path), ["false"])
        with pytest.raises(NotFound) as missing:
            await fleet.get("r-0000000000000000")
        with pytest.raises(Unavailable) as unreachable:
            await nowhere.get("r-0000000000000000")

    assert over.value.code == "RESOURCE_EXHAUSTED" and over.value.retry_after_s == 2.0
    assert "at its limit of 1" in over.value.message
    assert missing.value.code == "NOT_FOUND" and isinstance(missing.value, FleetError)
    assert unreachable.value.code == "UNAVAILABLE" and "127.0.0.1:1" in unreachable.value.message


async def test_fleet_submit_reads_its_smolfile_once_and_opens_one_connection(
    tmp_path: Path, images: ImageStore, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`fleet submit` with inputs (a file and a directory, both uploaded), outputs and a label:
    the Smolfile is parsed once, and uploads and submission share one connection."""
    from fleet.cli.main import main

    smolfile = _smolfile(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a\n")
    (tmp_path / "config.json").write_text("{}\n")
    parsed: list[str] = []
    parse = smolfile_module.parse_smolfile

    def counted(text: str, name: str = "<smolfile>") -> Any:
        parsed.append(name)
        return parse(text, name)

    monkeypatch.setattr(smolfile_module, "parse_smolfile", counted)
    async with fleet_with_a_host(tmp_path, images) as h, proxied(h.server.address) as proxy:
        argv = ["submit", "--server", proxy.address, "--plaintext", "-s", str(smolfile),
                "--step", "true", "--input", f"{tmp_path / 'data'}:/in/data",
                "--input", f"{tmp_path / 'config.json'}:/in/config.json",
                "--output", "/out", "--label", "case=one-door", "-q"]  # fmt: skip
        code = await asyncio.to_thread(main, argv)
        out = capsys.readouterr()
        rollout_id = out.out.strip().splitlines()[-1]  # (the server logs here too)
        async with AsyncFleet(h.server.address, plaintext=True) as fleet:
            stored = await fleet.get(rollout_id)

    assert code == 0, out.err
    assert (parsed, proxy.connections) == ([str(smolfile)], 1)
    assert stored.labels == {"case": "one-door"}
    inputs = stored.wire_json()["manifest"]["inputs"]
    assert sorted(i["path"] for i in inputs) == ["/in/config.json", "/in/data"]


async def test_the_command_line_prints_a_refusal_with_its_code(
    tmp_path: Path, images: ImageStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refusal reaches the shell as fleet's error: its code, its message, its retry hint,
    and exit status 2."""
    from fleet.cli.main import main

    config = ServerConfig(lease_ttl_s=5.0, heartbeat_interval_s=0.5, token_secret=SECRET,
                          max_active_per_tenant=1)  # fmt: skip
    async with fleet_with_a_host(tmp_path, images, config) as h:
        common = ["--server", h.server.address, "--plaintext"]
        first = await asyncio.to_thread(
            main, ["submit", *common, "-s", str(_smolfile(tmp_path)), "--step", "true"]
        )
        capsys.readouterr()
        over = await asyncio.to_thread(
            main, ["submit", *common, "-s", str(_smolfile(tmp_path)), "--step", "false"]
        )
        over_err = capsys.readouterr().err
        missing = await asyncio.to_thread(main, ["get", *common, "r-0000000000000000"])
        missing_err = capsys.readouterr().err

    assert first == 0
    assert over == 2 and "fleet submit: RESOURCE_EXHAUSTED:" in over_err
    assert "(retry after 2s)" in over_err
    assert missing == 2 and "fleet get: NOT_FOUND:" in missing_err


@pytest.mark.sandbox
async def test_submit_waits_on_its_one_connection_and_get_downloads_the_outputs(
    tmp_path: Path, images: ImageStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fleet submit --wait` uploads, submits, watches to the end and prints the result over
    one connection; `fleet get --download` writes the outputs out."""
    from fleet.cli.main import main

    (tmp_path / "in.txt").write_text("from the submitter\n")
    async with (
        harness(tmp_path, images, runtime=namespace_runtime) as h,
        proxied(h.server.address) as proxy,
    ):
        await h.start_agent("cpu-a", HostClass.CPU)
        common = ["--server", proxy.address, "--plaintext"]
        step = "mkdir -p /out && tr a-z A-Z < /in/in.txt > /out/r.txt && cat /out/r.txt"
        submitted = await asyncio.to_thread(
            main, ["submit", *common, "-s", str(_smolfile(tmp_path)), "--step", f"sh -c '{step}'",
                   "--input", f"{tmp_path / 'in.txt'}:/in/in.txt", "--output", "/out/r.txt",
                   "--wait"],
        )  # fmt: skip
        out = capsys.readouterr().out
        connections = proxy.connections
        rollout_id = next(
            line.split()[1] for line in out.splitlines() if line.startswith("rollout")
        )
        got = await asyncio.to_thread(
            main, ["get", *common, rollout_id, "--download", str(tmp_path / "got")]
        )

    assert submitted == 0, out
    assert "state     SUCCEEDED" in out and "FROM THE SUBMITTER" in out and "-> SUCCEEDED" in out
    assert connections == 1
    assert got == 0 and (tmp_path / "got" / "r.txt").read_text() == "FROM THE SUBMITTER\n"
