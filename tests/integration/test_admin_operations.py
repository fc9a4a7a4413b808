"""AdminService's pool events, rollback and cost report: the typed clients (awaitable and
blocking) and `fleet pool events|rollback|report --server` see what the ledger holds, as
`--db` shows it on the server's machine; each call is logged with the key's id; bad input is
refused naming the field."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest
from structlog.testing import capture_logs

from fleet.api.pb import admin_pb2, admin_pb2_grpc
from fleet.client import AsyncFleet, Fleet
from fleet.core.errors import FailedPrecondition
from fleet.core.gates import Gates
from fleet.core.placement import HostClass, Pool
from fleet.image.store import ImageStore
from fleet.ledger.report import read_report
from tests.integration import test_admin_service as remote
from tests.integration.harness import Harness, harness, request


async def _fleet_with_history(h: Harness) -> None:
    """A cloud cpu host in pool `cloud` (gated on p95) and a gpu host in pool `gpus`, the
    local pool a rollback keeps (a secure harness's hosts all carry `fleet up`'s label); two
    rollouts done on the cloud host; its pool paused by its gate once."""
    await h.start_agent("cpu-a", HostClass.CPU, slots=2)
    await h.start_agent("gpu-0", HostClass.GPU, slots=2)
    ledger = h.server.core.ledger
    ledger.set_pool(Pool(name="cloud", host_class=HostClass.CPU, gates=Gates(p95_ms=500.0)),
                    time.time())  # fmt: skip
    ledger.set_pool(Pool(name="gpus", host_class=HostClass.GPU), time.time())
    for _ in range(2):
        rid = (await h.fleet.SubmitRollout(request())).rollout.id
        done = await h.wait_final(rid)
        assert done.host_id in ("cpu-a", "gpu-0")
    ledger.govern(time.time(), p95_ms=900.0)


async def test_pool_events_rollback_and_report_through_the_typed_clients(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, secure=True) as h:
        assert h.ca is not None
        await _fleet_with_history(h)
        ledger = h.server.core.ledger
        admin_id = ledger.identities.keys("default")[0].id
        with capture_logs() as logs:
            async with AsyncFleet(h.server.address, key=h.admin_key, ca=h.ca.pem) as fleet:
                [event] = await fleet.admin.pool_events(3600)
                assert (event.pool, event.kind) == ("cloud", "paused")
                assert event.figures["p95_ms"] == 900.0
                assert await fleet.admin.pool_events(3600, pool="other") == []

                report = await fleet.admin.report(3600, prices={"cpu": 3.6})
                local = read_report(ledger, 3600, time.time(), "", {"cpu": 3.6})
                assert [(g.name, g.completed, g.attempts, g.retries) for g in report.groups] == [
                    (g.name, g.completed, g.attempts, g.retries) for g in local.groups
                ]
                assert sum(g.completed for g in report.groups) == 2
                assert [g.cost for g in report.groups] == pytest.approx(
                    [g.cost for g in local.groups])  # fmt: skip
                assert report.prices == {"cpu": 3.6} and report.paused["cloud"][0] == 1
                assert report.caps and report.caps[0][0] == "cloud"
                assert sum(done for _, done, _ in report.slices) == 2
                by_label = await fleet.admin.report(3600, by_label="team")
                assert [g.name for g in by_label.groups] == ["-"] and by_label.by == "label team"

            # The blocking client: the same calls, run on its own loop (off this one, which
            # serves them).
            pem = h.ca.pem

            def blocking() -> tuple[list[str], object, list[str], object]:
                with Fleet(h.server.address, key=h.admin_key, ca=pem) as fleet:
                    drained = list(fleet.admin.rollback(300, "gpus").hosts)
                    state = fleet.admin.rollback_state()
                    with pytest.raises(FailedPrecondition, match="in force already"):
                        fleet.admin.rollback(300, "gpus")
                    undone = fleet.admin.undo_rollback()
                    return drained, state, undone, fleet.admin.rollback_state()

            drained, state, undone, after = await asyncio.to_thread(blocking)
        assert drained == ["cpu-a"] and undone == ["cpu-a"] and after is None
        assert isinstance(state, dict) and state["local_pool"] == "gpus"
        assert state["since"] == pytest.approx(time.time(), abs=60)
        assert ledger.rollback_state() is None
        assert ledger.host_states() == {"cpu-a": "ready", "gpu-0": "ready"}

    calls = [(e["rpc"], e["key_id"]) for e in logs if e["event"] == "admin_call"]
    for rpc in ("ListPoolEvents", "Report", "Rollback", "GetRollback", "UndoRollback"):
        assert (rpc, admin_id) in calls, rpc
    [refused] = [e for e in logs if e["event"] == "admin_call_refused"]
    assert (refused["rpc"], refused["key_id"]) == ("Rollback", admin_id)


async def test_bad_input_is_refused_naming_the_field(tmp_path: Path, images: ImageStore) -> None:
    async with harness(tmp_path, images, secure=True) as h:
        async with h.connect(h.admin_key) as channel:
            admin = admin_pb2_grpc.AdminServiceStub(channel)
            for call, req, field in (
                ("Report", admin_pb2.ReportRequest(), "ReportRequest.window_s"),
                ("Report", admin_pb2.ReportRequest(window_s=60, prices={"cpu": -1}),
                 "ReportRequest.prices['cpu']"),
                ("ListPoolEvents", admin_pb2.ListPoolEventsRequest(window_s=float("nan")),
                 "ListPoolEventsRequest.window_s"),
                ("Rollback", admin_pb2.RollbackRequest(deadline=1), "RollbackRequest.deadline"),
                ("Rollback", admin_pb2.RollbackRequest(deadline=time.time() + 60,
                                                       local_pool="nope"), "no pool 'nope'"),
            ):  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await getattr(admin, call)(req)
                assert field in (refused.value.details() or ""), (call, refused.value.details())
            with pytest.raises(grpc.aio.AioRpcError) as none:
                await admin.UndoRollback(admin_pb2.UndoRollbackRequest())
            assert none.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert h.server.core.ledger.rollback_state() is None  # (nothing refused took effect)


async def test_the_cli_reports_rolls_back_and_lists_events_through_the_server(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path / "server", images, secure=True) as h:
        assert h.ca is not None
        await _fleet_with_history(h)
        ledger = h.server.core.ledger
        db = str(tmp_path / "server" / "ledger.sqlite3")
        home = tmp_path / "operator"
        home.mkdir()
        (home / "fleet-ca.crt").write_bytes(h.ca.pem)
        through = ["--server", h.server.address, "--key", h.admin_key, "--ca", "fleet-ca.crt"]

        async def both(*argv: str) -> tuple[str, str]:
            """`fleet ARGV` through the server, and on the ledger (as the server's machine)."""
            rc, out, err = await remote.fleet_cli(home, *argv, *through)
            assert rc == 0, err
            rc, on_db, err = await remote.fleet_cli(home, *argv, "--db", db)
            assert rc == 0, err
            return out, on_db

        out, on_db = await both("pool", "events", "--since", "1h")
        assert "cloud        paused   new dispatches paused" in out and out == on_db

        out, on_db = await both("report", "--since", "1h", "--price", "cpu=3.6/h", "--json")
        got, want = json.loads(out), json.loads(on_db)
        assert got["groups"] == want["groups"] and got["prices"] == {"cpu": 3.6}
        assert sum(g["completed"] for g in got["groups"]) == 2
        assert got["paused"]["cloud"]["times"] == 1
        chart = home / "report.png"
        rc, out, err = await remote.fleet_cli(home, "report", "--since", "1h", "--chart",
                                              str(chart), *through)  # fmt: skip
        assert rc == 0, err
        assert "rollouts ended in the last 1h, by pool" in out and "completed" in out
        if "chart: not written" not in err:  # (matplotlib is the demo extra's)
            assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

        rc, out, err = await remote.fleet_cli(home, "rollback", *through)
        assert (rc, out.strip()) == (0, "no rollback in force"), err
        rc, out, err = await remote.fleet_cli(home, "rollback", "--to", "local-only",
                                              "--deadline", "5m", "--local-pool", "gpus",
                                              *through)  # fmt: skip
        assert rc == 0 and "1 hosts draining" in out and "(cpu-a)" in out, err
        assert ledger.host_states()["cpu-a"].startswith("drain")  # (drained: it holds none)
        rc, out, err = await remote.fleet_cli(home, "rollback", *through)
        assert rc == 0 and out.startswith("rolled back to the local pool (gpus) since"), err
        rc, out, err = await remote.fleet_cli(home, "rollback", "--to", "local-only", *through)
        assert rc == 2 and "in force already" in err
        rc, out, err = await remote.fleet_cli(home, "rollback", "--undo", *through)
        assert rc == 0 and "1 hosts ready again (cpu-a)" in out, err
        assert ledger.host_states()["cpu-a"] == "ready" and ledger.rollback_state() is None

        tenant = ["--server", h.server.address, "--key", h.key("team-a"), "--ca", "fleet-ca.crt"]
        for argv in (["pool", "events"], ["rollback"], ["rollback", "--to", "local-only"],
                     ["report", "--json"]):  # fmt: skip
            rc, out, err = await remote.fleet_cli(home, *argv, *tenant)
            assert rc == 2 and "PERMISSION_DENIED" in err, (argv, err)
        assert ledger.rollback_state() is None
        assert not (home / "ledger.sqlite3").exists()  # (no ledger was opened on its side)
