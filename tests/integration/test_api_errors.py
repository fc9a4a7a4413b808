"""fleet's errors on the wire: every call kind, streaming ones included, ends a refusal with the
canonical status and the rich details (ErrorInfo with the request id, RetryInfo with the retry
hint), before or after its first message; every line a call logs names its rpc and request id;
a client reads each refusal back as fleet's own exception; and SessionService is in reflection
and health like the other services.

The refusals with a retry hint come from a scripted servicer on a real grpc.aio server with the
real interceptor (fleet's own servers refuse streaming calls with retry hints only under load);
the rest from a real fleet server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from fleet.api.interceptor import REQUEST_ID_METADATA, ApiInterceptor
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, host_pb2_grpc, types_pb2
from fleet.api.status import DOMAIN, error_from_rpc
from fleet.core.errors import (
    Aborted,
    ErrorCode,
    FleetError,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from fleet.image.store import ImageStore
from tests.integration.harness import harness


def _details(status: status_pb2.Status) -> tuple[Any, Any]:
    """(ErrorInfo, RetryInfo) of a rich status; None for either that is not there."""
    info = retry = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
    return info, retry


def _error_named(name: str) -> type[FleetError]:
    return next(kind for kind in FleetError.__subclasses__() if kind.__name__ == name)


class Scripted(fleet_pb2_grpc.FleetServiceServicer):  # type: ignore[misc]
    """FleetService whose calls refuse as the request asks."""

    async def WatchRollout(
        self, request: fleet_pb2.WatchRolloutRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[types_pb2.RolloutEvent]:
        structlog.get_logger("scripted").info("watch_started")
        if request.id == "busy":
            raise ResourceExhausted("the queue is full", retry_after_s=2.5, details={"depth": "7"})
        for sequence in (1, 2):
            yield types_pb2.RolloutEvent(sequence=sequence, rollout_id=request.id)
        if request.id == "crash":
            raise RuntimeError("SELECT secret FROM api_keys")
        raise Unavailable("its host went away", retry_after_s=1.25)

    async def GetRollout(
        self, request: fleet_pb2.GetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> types_pb2.Rollout:
        """Raises the FleetError subclass the id names, with a retry hint and a detail."""
        raise _error_named(request.id)(
            f"{request.id} refused", retry_after_s=0.5, details={"why": request.id}
        )

    async def PutBlob(
        self, requests: AsyncIterator[fleet_pb2.BlobPart], context: grpc.aio.ServicerContext
    ) -> fleet_pb2.PutBlobResponse:
        async for _ in requests:
            pass
        raise PermissionDenied("no uploads today", retry_after_s=3.0)


class ScriptedHosts(host_pb2_grpc.HostServiceServicer):  # type: ignore[misc]
    """A streaming handler that writes with `context.write` (not by yielding)."""

    async def SessionCommands(
        self, replies: AsyncIterator[host_pb2.SessionReply], context: grpc.aio.ServicerContext
    ) -> None:
        await context.write(host_pb2.SessionCommand(call_id="c-1", work_id="w-1"))
        raise Aborted("this stream is superseded", retry_after_s=0.75)


@contextlib.asynccontextmanager
async def scripted_address() -> AsyncIterator[str]:
    """A real grpc.aio server on loopback with the scripted services and fleet's interceptor."""
    server = grpc.aio.server(interceptors=[ApiInterceptor()])
    fleet_pb2_grpc.add_FleetServiceServicer_to_server(Scripted(), server)
    host_pb2_grpc.add_HostServiceServicer_to_server(ScriptedHosts(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def scripted_server() -> AsyncIterator[grpc.aio.Channel]:
    async with scripted_address() as address, grpc.aio.insecure_channel(address) as channel:
        yield channel


@pytest.fixture
def logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every event logged while the test runs, with the context bound in contextvars."""
    capture = structlog.testing.LogCapture()
    saved = structlog.get_config()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, capture],
        cache_logger_on_first_use=False,
    )
    try:
        yield capture.entries
    finally:
        structlog.configure(**saved)


async def test_a_streaming_refusal_before_any_message_carries_retry_info_and_error_info() -> None:
    async with scripted_server() as channel:
        call = fleet_pb2_grpc.FleetServiceStub(channel).WatchRollout(
            fleet_pb2.WatchRolloutRequest(id="busy"),
            metadata=((REQUEST_ID_METADATA, "req-busy-1"),),
            timeout=30,
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    err = caught.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.details() == "the queue is full"
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    info, retry = _details(status)
    assert retry is not None and retry.retry_delay.ToNanoseconds() == 2_500_000_000
    assert info is not None
    assert (info.reason, info.domain) == ("RESOURCE_EXHAUSTED", DOMAIN)
    assert info.metadata["request_id"] == "req-busy-1"
    assert info.metadata["rpc"] == "WatchRollout"
    assert info.metadata["depth"] == "7"
    # The plain trailers earlier clients read are still there.
    assert float(dict(err.trailing_metadata() or ())["retry-after-s"]) == 2.5


async def test_a_refusal_after_some_messages_is_mapped_too() -> None:
    """A yielding handler and a `context.write` one: the messages sent, then the status."""
    async with scripted_server() as channel:
        got: list[int] = []
        call = fleet_pb2_grpc.FleetServiceStub(channel).WatchRollout(
            fleet_pb2.WatchRolloutRequest(id="r-midway"), timeout=30
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for event in call:
                got.append(event.sequence)
        assert got == [1, 2]
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        error = error_from_rpc(caught.value)
        assert isinstance(error, Unavailable) and error.retry_after_s == 1.25
        assert error.message == "its host went away" and error.details["request_id"]

        async def replies() -> AsyncIterator[host_pb2.SessionReply]:
            yield host_pb2.SessionReply(host_id="h-1")

        commands: list[str] = []
        stream = host_pb2_grpc.HostServiceStub(channel).SessionCommands(replies(), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for command in stream:
                commands.append(command.work_id)
        assert commands == ["w-1"]
        assert caught.value.code() == grpc.StatusCode.ABORTED
        status = rpc_status.from_call(caught.value)
        assert status is not None
        info, retry = _details(status)
        assert info.metadata["rpc"] == "SessionCommands" and info.reason == "ABORTED"
        assert retry.retry_delay.ToNanoseconds() == 750_000_000


async def test_a_client_stream_refusal_carries_the_details() -> None:
    async def parts() -> AsyncIterator[fleet_pb2.BlobPart]:
        for _ in range(3):
            yield fleet_pb2.BlobPart(data=b"x" * 10)

    async with scripted_server() as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await fleet_pb2_grpc.FleetServiceStub(channel).PutBlob(
                parts(), metadata=((REQUEST_ID_METADATA, "req-put"),), timeout=30
            )
    error = error_from_rpc(caught.value)
    assert isinstance(error, PermissionDenied)
    assert error.retry_after_s == 3.0 and error.details["request_id"] == "req-put"


async def test_a_crash_mid_stream_is_internal_and_keeps_its_details_in_the_log(
    logs: list[MutableMapping[str, Any]],
) -> None:
    async with scripted_server() as channel:
        call = fleet_pb2_grpc.FleetServiceStub(channel).WatchRollout(
            fleet_pb2.WatchRolloutRequest(id="crash"), timeout=30
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "SELECT" not in (caught.value.details() or "")
    assert "RuntimeError" in (caught.value.details() or "")
    crashed = [e for e in logs if e["event"] == "request_crashed"]
    assert len(crashed) == 1 and crashed[0]["rpc"] == "WatchRollout"
    assert crashed[0].get("exc_info") is True


async def test_every_line_a_streaming_call_logs_names_its_rpc_and_request_id(
    logs: list[MutableMapping[str, Any]],
) -> None:
    async with scripted_server() as channel:
        call = fleet_pb2_grpc.FleetServiceStub(channel).WatchRollout(
            fleet_pb2.WatchRolloutRequest(id="busy"),
            metadata=((REQUEST_ID_METADATA, "req-logged"),),
            timeout=30,
        )
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in call:
                pass
    lines = [e for e in logs if e["event"] in ("watch_started", "request_refused")]
    assert [e["event"] for e in lines] == ["watch_started", "request_refused"]
    for line in lines:
        assert line["rpc"] == "WatchRollout" and line["request_id"] == "req-logged"
        assert line["peer"]


async def test_a_fleet_servers_streaming_calls_log_and_refuse_with_their_request_id(
    tmp_path: Path, images: ImageStore, logs: list[MutableMapping[str, Any]]
) -> None:
    """The real server: GetBlob's own log line and its refusal name the call."""
    async with harness(tmp_path, images) as h:
        call = h.hosts.GetBlob(
            host_pb2.GetBlobRequest(digest="sha256:" + "0" * 64, work_id="w-nobody"),
            metadata=((REQUEST_ID_METADATA, "req-blob-9"),),
            timeout=30,
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
        watch = h.fleet.WatchRollout(
            fleet_pb2.WatchRolloutRequest(id="r-1", after_sequence=-1), timeout=30
        )
        with pytest.raises(grpc.aio.AioRpcError) as negative:
            async for _ in watch:
                pass
    assert caught.value.code() == grpc.StatusCode.ABORTED
    error = error_from_rpc(caught.value)
    assert isinstance(error, Aborted) and error.details["request_id"] == "req-blob-9"
    served = [e for e in logs if e["event"] == "blob_served"]
    assert len(served) == 1
    assert served[0]["rpc"] == "GetBlob" and served[0]["request_id"] == "req-blob-9"
    assert negative.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert negative.value.details() == "after_sequence is negative"
    info, _ = _details(rpc_status.from_call(negative.value))
    assert info.reason == "INVALID_ARGUMENT" and info.metadata["rpc"] == "WatchRollout"
    assert info.metadata["request_id"]  # (one made by the server: the caller named none)


async def test_an_authentication_refusal_of_a_stream_carries_the_details(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images, secure=True) as h:
        async with h.connect(h.key("t1", "rollouts:write")) as channel:  # (cannot read)
            call = fleet_pb2_grpc.FleetServiceStub(channel).WatchRollout(
                fleet_pb2.WatchRolloutRequest(id="r-1"),
                metadata=((REQUEST_ID_METADATA, "req-auth"),),
                timeout=30,
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
        refusals = h.server.core.auth.refusals if h.server.core.auth else 0
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    info, _ = _details(rpc_status.from_call(caught.value))
    assert info.reason == "PERMISSION_DENIED" and info.metadata["request_id"] == "req-auth"
    assert info.metadata["key-id"]  # (the caller's own key, named in the message too)
    assert refusals == 1


async def test_error_from_rpc_round_trips_every_fleet_error() -> None:
    kinds = FleetError.__subclasses__()
    assert len(kinds) == len(ErrorCode)  # one class per code
    async with scripted_server() as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        for kind in kinds:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.GetRollout(
                    fleet_pb2.GetRolloutRequest(id=kind.__name__),
                    metadata=((REQUEST_ID_METADATA, f"req-{kind.__name__}"),),
                    timeout=30,
                )
            error = error_from_rpc(caught.value)
            assert type(error) is kind, (kind, caught.value.code())
            assert error.message == f"{kind.__name__} refused"
            assert error.retry_after_s == 0.5
            assert error.details["why"] == kind.__name__
            assert error.details["request_id"] == f"req-{kind.__name__}"


async def test_error_from_rpc_reads_a_sync_call_and_a_status_without_details() -> None:
    async with scripted_address() as target, grpc.aio.insecure_channel(target) as channel:

        def sync_call() -> FleetError:
            with grpc.insecure_channel(target) as sync_channel:
                try:
                    fleet_pb2_grpc.FleetServiceStub(sync_channel).GetRollout(
                        fleet_pb2.GetRolloutRequest(id="ResourceExhausted"), timeout=30
                    )
                except grpc.RpcError as exc:
                    return error_from_rpc(exc)
            raise AssertionError("the call was not refused")

        error = await asyncio.to_thread(sync_call)
        assert isinstance(error, ResourceExhausted) and error.retry_after_s == 0.5
        # A service this server does not serve: gRPC's own UNIMPLEMENTED, no fleet details.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await fleet_pb2_grpc.SessionServiceStub(channel).ListSessions(
                fleet_pb2.ListSessionsRequest(), timeout=30
            )
    plain = error_from_rpc(caught.value)
    assert type(plain).__name__ == "Internal" and "UNIMPLEMENTED" in plain.message


async def test_session_service_answers_reflection_and_health(
    tmp_path: Path, images: ImageStore
) -> None:
    async with harness(tmp_path, images) as h:
        health = health_pb2_grpc.HealthStub(h.channel)
        answers = {
            name: (await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=30))
            .status
            for name in ("", "fleet.v1.FleetService", "fleet.v1.SessionService",
                         "fleet.v1.HostService")
        }  # fmt: skip
        reflection = reflection_pb2_grpc.ServerReflectionStub(h.channel)

        async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        replies = [r async for r in reflection.ServerReflectionInfo(ask(), timeout=30)]
    assert set(answers.values()) == {health_pb2.HealthCheckResponse.SERVING}
    listed = {s.name for s in replies[0].list_services_response.service}
    assert {"fleet.v1.FleetService", "fleet.v1.SessionService", "fleet.v1.HostService"} <= listed
