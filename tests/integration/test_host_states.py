"""Cordoning a host: it takes no new work (checked in the claim's own transaction), others
do; uncordoned it takes work again; the CLI says so and refuses an unknown host."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

import fleet
from fleet.api.pb import fleet_pb2, host_pb2, types_pb2
from fleet.core.placement import (
    LOCAL_LABEL,
    HostCapabilities,
    HostClass,
    Isolation,
    Pool,
    RuntimeKind,
)
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from tests.integration.harness import harness, namespace_runtime, request

SUCCEEDED = types_pb2.ROLLOUT_STATE_SUCCEEDED


async def test_a_cordoned_host_takes_no_new_work_and_others_do(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images) as h:
        await h.register_host("h1")
        await h.register_host("h2")
        ledger = h.server.core.ledger

        async def claim(host: str) -> list[str]:
            reply = await h.hosts.ClaimWork(
                host_pb2.ClaimWorkRequest(
                    request_id=f"{host}-{id(object())}", host_id=host, max_items=5, wait_s=0
                )
            )
            return [i.rollout_id for i in reply.items]

        await asyncio.to_thread(ledger.set_host_state, "h1", "cordoned")
        first = await h.fleet.SubmitRollout(request())
        cordoned = await claim("h1")
        other = await claim("h2")
        await asyncio.to_thread(ledger.set_host_state, "h1", "ready")
        await h.fleet.SubmitRollout(request())
        again = await claim("h1")
        assert other == [first.rollout.id]
        state = (await asyncio.to_thread(ledger.host_states))["h1"]

    assert cordoned == [] and len(other) == 1 and len(again) == 1 and state == "ready"


async def test_fleet_host_cordon_and_list(tmp_path: Path, images: ImageStore) -> None:
    db = tmp_path / "ledger.sqlite3"

    ledger = Ledger.open(str(db))
    caps = HostCapabilities(
        host_id="cpu-1",
        host_class=HostClass.CPU,
        runtime=RuntimeKind.NAMESPACE,
        isolation=Isolation.NAMESPACE,
        cpus=2,
        memory_mib=1024,
        slots=2,
        cuda_devices=0,
    )
    ledger.register_host(caps, time.time())
    ledger.heartbeat("cpu-1", [], time.time(), 10.0, ["sha256:" + "ab" * 32])

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fleet.cli.main", "host", *argv, "--db", str(db)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    cordoned = cli("cordon", "cpu-1")
    assert cordoned.returncode == 0 and "takes no new work" in cordoned.stdout, cordoned.stderr
    listed = cli("list")
    assert any(
        line.split()[:3] == ["cpu-1", "cpu", "cordoned"] for line in listed.stdout.splitlines()
    )
    # The images column: how many the host's last beat said it holds, by short digest.
    assert listed.stdout.rstrip().endswith("1: abababababab"), listed.stdout
    assert cli("uncordon", "cpu-1").returncode == 0
    assert any(
        line.split()[:3] == ["cpu-1", "cpu", "ready"] for line in cli("list").stdout.splitlines()
    )
    unknown = cli("cordon", "nope")
    assert unknown.returncode == 2 and "no registered host 'nope'" in unknown.stderr
    silent = cli("list", "--unresponsive-after-s", "0")
    assert any(line.split()[:3] == ["cpu-1", "cpu", "unresponsive"]
               for line in silent.stdout.splitlines()), silent.stdout  # fmt: skip


async def test_agents_of_another_version_are_refused_saying_which_to_upgrade(
    tmp_path: Path, images: ImageStore
) -> None:
    """A server serves agents of its own minor version and the one before: a newer agent, or
    one that reports no version, is refused with FAILED_PRECONDITION; a real agent registers,
    and `fleet host list` shows its version and the slots its leases hold."""

    async with harness(tmp_path, images) as h:
        refused = []
        for version in ("99.0.0", ""):
            try:
                await h.hosts.RegisterHost(
                    host_pb2.RegisterHostRequest(
                        request_id="r",
                        host_id="odd",
                        host_class=types_pb2.HOST_CLASS_CPU,
                        agent_version=version,
                    )
                )
            except grpc.aio.AioRpcError as exc:
                refused.append((exc.code(), exc.details() or ""))
        await h.start_agent("cpu-a", HostClass.CPU, slots=3)
        views = await asyncio.to_thread(h.server.core.ledger.host_table, time.time(), 60.0)
        listed = [
            f"{v.capabilities.host_id} {v.state} {v.capabilities.agent_version} "
            f"{v.slots_used}/{v.capabilities.slots}"
            for v in views
        ]

    assert refused[0][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "upgrade the server" in refused[0][1] and "99.0.0" in refused[0][1]
    assert refused[1][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "upgrade the agent" in refused[1][1]
    assert listed == [f"cpu-a ready {fleet.__version__} 0/3"]


async def _until(check, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.1)):
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError("timed out waiting")


@pytest.mark.sandbox
async def test_a_drain_lets_work_finish_until_its_deadline_then_releases_the_rest(
    tmp_path: Path, images: ImageStore
) -> None:
    """`fleet host drain`: the host takes no new work; what finishes before the deadline
    finishes there; what still runs at the deadline is released and retried elsewhere, and
    finishes exactly once (its first attempt fenced off); then the host is drained."""

    slow = ["sh", "-c", 'if [ "$FLEET_ATTEMPT" = 1 ]; then sleep 120; fi; echo done']

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=2)
        ledger = h.server.core.ledger
        short = (
            await h.fleet.SubmitRollout(request('image = "minimal"\n', ["sleep", "2"]))
        ).rollout.id
        held = (await h.fleet.SubmitRollout(request('image = "minimal"\n', slow))).rollout.id

        async def both_running() -> bool:
            states = [
                (await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=i))).state
                for i in (short, held)
            ]
            return all(s == types_pb2.ROLLOUT_STATE_RUNNING for s in states)

        await _until(both_running)
        await asyncio.to_thread(ledger.set_host_state, "cpu-a", "draining", time.time() + 6)
        later = (await h.fleet.SubmitRollout(request())).rollout.id
        await asyncio.sleep(1.5)
        not_taken = (await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=later))).state
        await h.start_agent("cpu-b", HostClass.CPU, slots=2)
        done = {i: await h.wait_final(i, timeout_s=90) for i in (short, held, later)}

        async def drained() -> str:
            state = (await asyncio.to_thread(ledger.host_states))["cpu-a"]
            return state if state == "drained" else ""

        state = await _until(drained)
        events = await asyncio.to_thread(ledger.events, held, 0)
        r = {
            "done": done,
            "not_taken": not_taken,
            "state": state,
            "events": [e.kind for e in events],
            "ids": (short, held, later),
        }

    short, held, later = r["ids"]  # type: ignore[misc]
    done: dict[str, object] = r["done"]  # type: ignore[assignment]
    assert r["not_taken"] == types_pb2.ROLLOUT_STATE_QUEUED
    a, b, c = done[short], done[held], done[later]
    assert (a.state, a.attempts, a.host_id) == (SUCCEEDED, 1, "cpu-a")  # type: ignore[attr-defined]
    assert (b.state, b.attempts, b.host_id) == (SUCCEEDED, 2, "cpu-b")  # type: ignore[attr-defined]
    assert [s.stdout for s in b.results] == [b"done\n"]  # type: ignore[attr-defined]
    assert c.host_id == "cpu-b"  # type: ignore[attr-defined]
    assert r["state"] == "drained"
    assert r["events"].count("lease_expired") == 1  # type: ignore[attr-defined]


async def test_an_agent_told_to_stop_drains_its_host_first(
    tmp_path: Path, images: ImageStore
) -> None:
    """SIGTERM (the agent's stop): the server hears at once that the host drains, the running
    step finishes, the agent exits, the host is drained; registered again, it takes work."""

    async with harness(tmp_path, images) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=2, drain_deadline_s=60)
        ledger = h.server.core.ledger
        work = (
            await h.fleet.SubmitRollout(request('image = "minimal"\n', ["sleep", "2"]))
        ).rollout.id

        async def running() -> bool:
            r = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=work))
            return r.state == types_pb2.ROLLOUT_STATE_RUNNING

        await _until(running)
        stop, task = h.agents.pop("cpu-a")
        stop.set()

        async def draining() -> str:
            state = (await asyncio.to_thread(ledger.host_states))["cpu-a"]
            return state if state in ("draining", "drained") else ""

        seen = await _until(draining)
        await asyncio.wait_for(task, 60)
        finished = await h.wait_final(work)

        async def drained() -> bool:
            return (await asyncio.to_thread(ledger.host_states))["cpu-a"] == "drained"

        await _until(drained)
        await h.start_agent("cpu-a", HostClass.CPU, slots=2)
        again = await h.wait_final((await h.fleet.SubmitRollout(request())).rollout.id)
        r = {
            "seen": seen,
            "finished": (finished.state, finished.attempts),
            "again": (again.state, again.host_id),
            "state": (await asyncio.to_thread(ledger.host_states))["cpu-a"],
        }

    assert r["seen"] in ("draining", "drained")
    assert r["finished"] == (SUCCEEDED, 1)
    assert r["again"] == (SUCCEEDED, "cpu-a") and r["state"] == "ready"


async def test_an_agent_stopped_while_its_claims_answer_is_in_flight_drains_what_it_leased(
    tmp_path: Path, images: ImageStore
) -> None:
    """The server leases work to a claim and the agent is told to stop before the answer
    reaches it: the agent asks again under the same request id, gets that lease, and drains
    it (the work runs to its end there) rather than leave it to expire."""

    async with harness(tmp_path, images) as h:
        servicer = h.server.host_servicer
        claim = servicer._claim
        granted = asyncio.Event()
        held: list[str] = []
        repeated: list[str] = []

        async def answer_held(
            host_id: str, max_items: int, request_id: str
        ) -> list[host_pb2.WorkAssignment]:
            # The ledger has committed the lease; the first answer that carries one never
            # leaves (the agent, told to stop, cancels the call), the others go as they are.
            items = await claim(host_id, max_items, request_id)
            if held:
                repeated.append(request_id)
            elif items:
                held.append(request_id)
                granted.set()
                await asyncio.Event().wait()
            return items

        servicer._claim = answer_held  # type: ignore[method-assign]
        await h.start_agent("cpu-a", HostClass.CPU, slots=2, drain_deadline_s=60)
        ledger = h.server.core.ledger
        work = (
            await h.fleet.SubmitRollout(request('image = "minimal"\n', ["sleep", "2"]))
        ).rollout.id
        await asyncio.wait_for(granted.wait(), 30)
        stop, task = h.agents.pop("cpu-a")
        stop.set()
        await asyncio.wait_for(task, 60)
        # Read once the agent has ended: whatever it drained is reported by now.
        got = await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=work))
        events = [e.kind for e in await asyncio.to_thread(ledger.events, work, 0)]
        state = (await asyncio.to_thread(ledger.host_states))["cpu-a"]

    assert repeated == held, (held, repeated)  # asked once more, under the same request id
    assert (got.state, got.attempts, got.host_id) == (SUCCEEDED, 1, "cpu-a")
    assert "lease_expired" not in events, events
    assert state in ("draining", "drained")


def test_fleet_pool_set_list_and_delete(tmp_path: Path) -> None:
    """Pools from the CLI: made, listed with their hosts and what they run against the cap,
    changed, deleted; a malformed label is refused."""

    db = tmp_path / "ledger.sqlite3"
    ledger = Ledger.open(str(db))
    for host_id, site in (("c1", "cloud"), ("l1", "local")):
        ledger.register_host(
            HostCapabilities(
                host_id=host_id, host_class=HostClass.CPU, runtime=RuntimeKind.NAMESPACE,
                isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
                labels={"site": site},
            ),
            time.time(),
        )  # fmt: skip
    ledger.engine.dispose()

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fleet.cli.main", "pool", *argv, "--db", str(db)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    made = cli("set", "cloud", "--class", "cpu", "--label", "site=cloud", "--max-running", "16")
    assert made.returncode == 0 and "at most 16 running" in made.stdout, made.stderr
    listed = cli("list").stdout.splitlines()
    # pool, class, running/cap, slots, cap kind, state, hosts, labels, gates, members
    assert listed[1].split() == [
        "cloud", "cpu", "0/16", "1", "fixed", "ready", "1", "site=cloud", "-", "c1"
    ]  # fmt: skip
    assert cli("set", "cloud", "--class", "cpu", "--label", "site=cloud",
               "--max-running", "4").returncode == 0  # fmt: skip
    assert cli("list").stdout.splitlines()[1].split()[2] == "0/4"
    gated = cli("set", "cloud", "--class", "cpu", "--label", "site=cloud", "--adaptive",
                "--start", "3", "--gate-p95-ms", "500", "--gate-retry-rate", "0.2")  # fmt: skip
    assert "an adaptive cap from 3, +2 every 10s" in gated.stdout, gated.stderr
    assert "gates p95<=500ms retries<=20% over 60s" in gated.stdout
    row = cli("list").stdout.splitlines()[1].split()
    assert row[2:5] == ["0/3", "1", "adaptive"] and row[8:10] == ["p95<=500ms", "retries<=20%"]
    bad = cli("set", "x", "--class", "cpu", "--label", "no-equals-sign")
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr, bad.stderr
    bad = cli("set", "x", "--class", "cpu", "--gate-retry-rate", "1.5")
    assert bad.returncode == 2 and "--gate-retry-rate: Input should be less than or equal to 1" \
        in bad.stderr, bad.stderr  # fmt: skip
    both = cli("set", "x", "--class", "cpu", "--adaptive", "--max-running", "4")
    assert both.returncode == 2 and "--max-running and --adaptive" in both.stderr
    ledger = Ledger.open(str(db))
    ledger.govern(time.time(), p95_ms=900.0)
    ledger.engine.dispose()
    events = cli("events", "--since", "1h").stdout
    assert "cloud        paused   new dispatches paused: gateway p95 latency 900.0 ms" in events
    assert "[artifact_failures=0 attempts=0 p95_ms=900 retried=0]" in events
    assert "paused since" in cli("list").stdout
    assert cli("delete", "cloud").returncode == 0
    assert cli("list").stdout.splitlines()[1:] == []
    gone = cli("delete", "cloud")
    assert gone.returncode == 2 and "no pool 'cloud'" in gone.stderr


@pytest.mark.sandbox
async def test_a_rollback_to_local_only_with_work_in_flight_loses_nothing(
    tmp_path: Path, images: ImageStore
) -> None:
    """`fleet rollback --to local-only` with cpu work running on a cloud host: that host
    drains, what it still runs at the deadline is retried on the local gpu host, queued and new
    cpu work runs there too; every rollout finishes exactly once. Undone, the cloud host takes
    cpu work again and the gpu host no longer does."""

    slow = ["sh", "-c", 'if [ "$FLEET_ATTEMPT" = 1 ]; then sleep 120; fi; echo done']

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("gpu-0", HostClass.GPU, slots=4)
        await h.start_agent("cpu-a", HostClass.CPU, slots=2)
        ledger = h.server.core.ledger
        held = [
            (await h.fleet.SubmitRollout(request('image = "minimal"\n', slow))).rollout.id
            for _ in range(2)
        ]

        async def both_running() -> bool:
            states = [
                (await h.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=i))).state for i in held
            ]
            return all(s == types_pb2.ROLLOUT_STATE_RUNNING for s in states)

        await _until(both_running)
        queued = (await h.fleet.SubmitRollout(request())).rollout.id  # (no slot on cpu-a)
        drained = await asyncio.to_thread(ledger.rollback, time.time() + 2, time.time())
        new = (await h.fleet.SubmitRollout(request())).rollout.id
        done = {i: await h.wait_final(i, timeout_s=90) for i in [*held, queued, new]}
        undone = await asyncio.to_thread(ledger.undo_rollback)
        after = await h.wait_final((await h.fleet.SubmitRollout(request())).rollout.id)
        r = {
            "drained": drained,
            "done": done,
            "undone": undone,
            "after": after,
            "ids": (held, queued, new),
        }

    held, queued, new = r["ids"]  # type: ignore[misc]
    done: dict[str, object] = r["done"]  # type: ignore[assignment]
    assert r["drained"] == ["cpu-a"] and r["undone"] == ["cpu-a"]
    for rollout_id in held:
        got = done[rollout_id]
        assert (got.state, got.attempts, got.host_id) == (SUCCEEDED, 2, "gpu-0")  # type: ignore[attr-defined]
        assert [s.stdout for s in got.results] == [b"done\n"]  # type: ignore[attr-defined]
    for rollout_id in (queued, new):
        got = done[rollout_id]
        assert (got.state, got.host_id) == (SUCCEEDED, "gpu-0")  # type: ignore[attr-defined]
    after = r["after"]
    assert (after.state, after.host_id) == (SUCCEEDED, "cpu-a")  # type: ignore[attr-defined]


def test_the_rollback_cli(tmp_path: Path) -> None:
    """fleet rollback: status, --to local-only (the cloud host drains, the gpu host and
    fleet up's agents stay), a second rollback refused, --undo, and undo with none refused."""

    db = tmp_path / "ledger.sqlite3"
    ledger = Ledger.open(str(db))
    for host_id, cls, labels in (("cloud-1", HostClass.CPU, {}), ("gpu-0", HostClass.GPU, {}),
                                 ("cpu-0", HostClass.CPU, {LOCAL_LABEL: "1"})):  # fmt: skip
        ledger.register_host(
            HostCapabilities(
                host_id=host_id, host_class=cls, runtime=RuntimeKind.NAMESPACE,
                isolation=Isolation.NAMESPACE, cpus=2, memory_mib=1024, cuda_devices=0,
                labels=labels,
            ),
            time.time(),
        )  # fmt: skip
    ledger.engine.dispose()

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "fleet.cli.main", "rollback", *argv, "--db", str(db)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    assert cli().stdout.strip() == "no rollback in force"
    rolled = cli("--to", "local-only", "--deadline", "5m")
    assert rolled.returncode == 0 and "1 hosts draining" in rolled.stdout, rolled.stderr
    assert "(cloud-1)" in rolled.stdout and "rolled back" in cli().stdout
    again = cli("--to", "local-only")
    assert again.returncode == 2 and "in force already" in again.stderr
    states = Ledger.open(str(db)).host_states()
    assert states == {"cloud-1": "draining", "gpu-0": "ready", "cpu-0": "ready"}
    undone = cli("--undo")
    assert undone.returncode == 0 and "1 hosts ready again (cloud-1)" in undone.stdout
    assert cli("--undo").returncode == 2


@pytest.mark.sandbox
async def test_the_report_prices_what_the_cgroup_measured(
    tmp_path: Path, images: ImageStore
) -> None:
    """A known load (a second of CPU, 64 MiB touched): its attempt records the CPU seconds
    and peak memory its machine's cgroup measured, and `fleet report` prices its wall time
    as one slot of its host at the class's price, by pool."""

    code = (
        "import time\nb = bytearray(64 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
        "t = time.process_time()\nwhile time.process_time() - t < 1.0: pass"
    )
    burn = ["python3", "-c", code]

    async with harness(tmp_path, images, runtime=namespace_runtime) as h:
        await h.start_agent("cpu-a", HostClass.CPU, slots=2)
        ledger = h.server.core.ledger
        await asyncio.to_thread(
            ledger.set_pool, Pool(name="cloud", host_class=HostClass.CPU), time.time()
        )
        rid = (await h.fleet.SubmitRollout(request('image = "minimal"\n', burn))).rollout.id
        done = await h.wait_final(rid)
        [cost] = await asyncio.to_thread(ledger.cost_attempts, 0.0)
        [view] = await asyncio.to_thread(ledger.host_table, time.time(), 60.0)
        # The agent said what its disk holds: the image the rollout ran on, among them.
        assert images.record("minimal").digest in view.images  # type: ignore[union-attr]
        db = Path(str(ledger.engine.url).removeprefix("sqlite:///"))

    assert done.state == SUCCEEDED  # type: ignore[attr-defined]
    assert cost.group == "cloud" and cost.final and cost.succeeded  # type: ignore[attr-defined]
    assert 1.0 <= cost.cpu_s < 5.0  # type: ignore[attr-defined]
    assert 64 <= cost.peak_memory_mib < 512  # type: ignore[attr-defined]
    chart = tmp_path / "report.png"
    report = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "fleet.cli.main", "report", "--since", "1h",
         "--price", "cpu=3.6/h", "--db", str(db), "--chart", str(chart)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    row = next(line.split() for line in report.stdout.splitlines() if line.startswith("cloud"))
    assert row[1:4] == ["1", "1", "0"]  # completed, attempts, retries
    expected = cost.wall_s / 3600 * 3.6 / 2  # type: ignore[attr-defined]
    assert float(row[4]) == pytest.approx(expected, abs=1e-4)
    assert float(row[6]) == pytest.approx(cost.cpu_s, abs=0.01)  # type: ignore[attr-defined]
    assert float(row[7]) == pytest.approx(cost.device_s)  # type: ignore[attr-defined]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"chart: {chart}" in report.stdout
