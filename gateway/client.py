"""Many concurrent model calls over one InferStream, for a caller that makes many.

    async with grpc.aio.insecure_channel(address) as channel:
        async with InferStreamClient(InferenceServiceStub(channel)) as gateway:
            answer = await gateway.infer(request)  # from any number of tasks at once

A call's answer is matched to it by its request_id (which must be set, and not be one already
waiting on this client). A refusal the gateway answers in-band raises the FleetError it names,
its retry hint in `retry_after_s`. If the stream ends or breaks, every call still waiting
raises Unavailable: resumable, since the same request (same rollout and idempotency key) on a
new stream gets the answer the gateway stored, not a fresh sample.

Imports neither torch nor the gateway's service: a trainer or a load generator can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

import grpc

from fleet.api.pb import inference_pb2, inference_pb2_grpc
from fleet.core.errors import InvalidArgument, Unavailable, error_for


class InferStreamClient:
    def __init__(self, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
        self._stub = stub
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._waiting: dict[str, asyncio.Future[inference_pb2.InferResponse]] = {}
        self._writing = asyncio.Lock()  # one message on the stream at a time
        self._ended = ""  # why no more calls can be made, once that is so

    async def __aenter__(self) -> InferStreamClient:
        self._call = self._stub.InferStream()
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def infer(self, request: inference_pb2.InferRequest) -> inference_pb2.InferResponse:
        """The gateway's answer to `request`, or the FleetError it refused it with."""
        if self._call is None:
            raise InvalidArgument("InferStreamClient: use it as `async with` (no stream open)")
        if self._ended:
            raise Unavailable(f"{self._ended}; open a new stream and retry", retry_after_s=0.1)
        rid = request.request_id
        if not rid:
            raise InvalidArgument("request_id is empty: on a stream, answers are matched by it")
        if rid in self._waiting:
            raise InvalidArgument(f"request_id {rid!r} is already waiting on this stream")
        future: asyncio.Future[inference_pb2.InferResponse] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[rid] = future
        try:
            try:
                async with self._writing:
                    await self._call.write(request)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                if not future.done():  # (the reader may have failed it already, saying why)
                    raise Unavailable(
                        f"the stream to the gateway broke ({exc}); open a new one and retry",
                        retry_after_s=0.1,
                    ) from exc
            return await future
        finally:
            if self._waiting.get(rid) is future:
                del self._waiting[rid]

    async def close(self) -> None:
        """Half-closes the stream and waits for the answers still owed to it."""
        if self._call is None or self._reader is None:
            return
        if not self._ended:
            self._ended = "this stream was closed"
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                async with self._writing:
                    await self._call.done_writing()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        assert self._call is not None
        why = "the gateway ended the stream"
        try:
            async for response in self._call:
                future = self._waiting.pop(response.request_id, None)
                if future is None or future.done():  # its caller gave up waiting
                    continue
                if response.HasField("error"):
                    e = response.error
                    hint = e.retry_after_s if e.HasField("retry_after_s") else None
                    future.set_exception(error_for(e.code, e.message, hint))
                else:
                    future.set_result(response.answer)
        except grpc.aio.AioRpcError as exc:
            why = f"the stream to the gateway broke ({exc.code().name}: {exc.details()})"
        finally:
            self._ended = self._ended or why
            waiting, self._waiting = self._waiting, {}
            for future in waiting.values():
                if not future.done():
                    future.set_exception(
                        Unavailable(
                            f"{why} before answering; retry on a new stream (the same "
                            "idempotency key gets the stored answer)",
                            retry_after_s=0.1,
                        )
                    )
