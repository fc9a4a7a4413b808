"""FleetService: submitters' calls, each checked against its caller's tenant."""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import grpc
import structlog

from fleet.api import convert
from fleet.api.pb import (
    fleet_pb2,
    fleet_pb2_grpc,
    types_pb2,
)
from fleet.core.errors import (
    FailedPrecondition,
    FleetError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from fleet.core.manifest import (
    MAX_STEPS,
    Manifest,
    SubmitRequest,
    build_manifest,
    image_of,
    validate_request,
)
from fleet.core.rollout import Rollout
from fleet.core.smolfile import ParsedSmolfile
from fleet.image import oci
from fleet.server.auth import Caller
from fleet.server.core import (
    MAX_LIST_BYTES,
    MIB,
    Core,
    SubmitBatcher,
)
from fleet.settings import ArtifactSettings, RegistrySettings, SettingsError

log = structlog.get_logger(__name__)

MAX_BATCH_SUBMIT = 1000
"""Submissions one SubmitRollouts call may carry."""
RESOLVE_THREADS = 16
"""Registry resolutions running at once in this process, all tenants together."""
RESOLVE_CACHE_ENTRIES = 1024
_resolve_pool: ThreadPoolExecutor | None = None


def resolve_pool() -> ThreadPoolExecutor:
    """The threads registry resolutions run on: their own, so that registries that answer
    slowly hold none of the threads every other call's work runs on."""
    global _resolve_pool
    if _resolve_pool is None:
        _resolve_pool = ThreadPoolExecutor(RESOLVE_THREADS, thread_name_prefix="registry-resolve")
    return _resolve_pool


@dataclass
class _Slots:
    """One tenant's resolutions: a few at a time, the rest wait."""

    free: asyncio.Semaphore
    users: int = 0


@dataclass
class ImageResolver:
    """Registry images a Smolfile names, resolved to digests without holding the submission
    path: on threads of their own, at most `per_tenant` at once for one tenant (one tenant's
    slow registry takes that tenant's slots, not everyone's), each within `timeout_s` (a wait
    for a slot included), and a result reused for `cache_s`."""

    configured: str
    """The operator's image registry (`fleet serve --registry`)."""
    private: str
    """The artifacts repository, which no Smolfile may name."""
    ca_pem: bytes | None
    timeout_s: float
    per_tenant: int
    cache_s: float
    _slots: dict[str, _Slots] = field(default_factory=dict, init=False)
    _cache: collections.OrderedDict[str, tuple[float, tuple[str, str]]] = field(
        default_factory=collections.OrderedDict, init=False
    )

    async def resolve(self, tenant: str, image: str) -> tuple[str, str]:
        """(digest, pinned reference); refused at once where the registry is not allowed,
        UNAVAILABLE (with a retry hint) past the time bound."""
        policy = oci.RegistryPolicy.from_env([self.configured], [self.private])  # (no I/O)
        policy.check_tenant(oci.Reference.parse(image))
        loop = asyncio.get_running_loop()
        cached = self._cache.get(image)
        if cached is not None and loop.time() - cached[0] < self.cache_s:
            return cached[1]
        deadline = loop.time() + self.timeout_s
        slots = self._slots.setdefault(tenant, _Slots(asyncio.Semaphore(self.per_tenant)))
        slots.users += 1
        handed = acquired = False
        try:
            try:
                await asyncio.wait_for(slots.free.acquire(), self.timeout_s)
            except TimeoutError:
                raise self._late(image, "its other registry images still resolving") from None
            acquired = True
            call = functools.partial(oci.resolve, image, self.ca_pem, policy,
                                     max(deadline - loop.time(), 0.0))  # fmt: skip
            future = loop.run_in_executor(resolve_pool(), call)
            future.add_done_callback(lambda f: self._done(tenant, f))
            handed = True  # the slot is the thread's until it ends, answered or not
            try:
                result = await asyncio.wait_for(asyncio.shield(future),
                                                max(deadline - loop.time(), 0.0))  # fmt: skip
            except TimeoutError:
                raise self._late(image, "its registry did not answer") from None
        finally:
            if not handed:
                if acquired:
                    slots.free.release()
                self._leave(tenant)
        self._cache[image] = (loop.time(), result)
        self._cache.move_to_end(image)
        while len(self._cache) > RESOLVE_CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return result

    def _late(self, image: str, why: str) -> Unavailable:
        log.info("image_resolve_late", image=image, why=why, timeout_s=self.timeout_s)
        return Unavailable(
            f"image {image!r}: not resolved in {self.timeout_s:g} s ({why}; "
            "$FLEET_REGISTRY_RESOLVE_TIMEOUT_S): submit again later",
            retry_after_s=self.timeout_s,
        )

    def _done(self, tenant: str, future: asyncio.Future[tuple[str, str]]) -> None:
        if not future.cancelled():
            future.exception()  # seen here, raised to the waiter if it still waits
        self._slots[tenant].free.release()
        self._leave(tenant)

    def _leave(self, tenant: str) -> None:
        slots = self._slots[tenant]
        slots.users -= 1
        if slots.users == 0:
            del self._slots[tenant]


def check_priority(caller: Caller, priority: int) -> None:
    """Work is leased by priority across every tenant, so only an admin key (or a server
    without identity) may raise work above the default 0: a tenant may lower its own work's
    priority, never jump the other tenants' queue."""
    if priority > 0 and not caller.all_tenants:
        raise PermissionDenied(
            f"priority {priority}: a tenant key may submit at priority 0 or below; "
            "a higher priority needs an admin key"
        )


def in_batch(exc: FleetError, index: int, item: fleet_pb2.SubmitRolloutRequest) -> FleetError:
    """A batch item's refusal, named by its place and key: the batch is refused whole."""
    return type(exc)(
        f"rollouts[{index}] (idempotency key {item.idempotency_key!r}): {exc.message}; "
        "nothing was submitted",
        retry_after_s=exc.retry_after_s,
    )


class FleetServicer(fleet_pb2_grpc.FleetServiceServicer):  # type: ignore[misc]
    def __init__(self, core: Core) -> None:
        self.core = core
        self.submits = SubmitBatcher(core)
        try:
            registry = RegistrySettings.from_args(argparse.Namespace())
            artifacts = ArtifactSettings.from_args(argparse.Namespace())
        except SettingsError as exc:
            raise FailedPrecondition(str(exc)) from None
        cas = [core.config.registry_ca]
        if core.security is not None:
            cas.append(core.security.ca.pem)
        self.resolver = ImageResolver(
            core.config.registry, core.config.artifacts_registry, b"".join(cas) or None,
            registry.resolve_timeout_s, registry.resolves_per_tenant, registry.resolve_cache_s,
        )  # fmt: skip
        self.quota_bytes = int(artifacts.tenant_quota_gib * (1 << 30))
        """What one tenant's uploads may hold (0: no quota)."""

    async def SubmitRollout(
        self, request: fleet_pb2.SubmitRolloutRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.SubmitRolloutResponse:
        now = datetime.now(UTC)
        # Counted before any per-item work; the conversion and checks (pydantic, TOML) then
        # run off the event loop, so a large request delays no other call.
        if len(request.steps) > MAX_STEPS:
            raise ResourceExhausted(
                f"the plan has {len(request.steps)} steps, over the {MAX_STEPS}"
            )
        caller = self.core.caller()
        request.tenant = caller.tenant_for(request.tenant)
        check_priority(caller, request.priority)
        submit, parsed = await asyncio.to_thread(self._accept, request, now)
        rollout, created = await self.admit(
            submit, parsed, now, request.image_upload, request.request_id
        )
        return fleet_pb2.SubmitRolloutResponse(
            rollout=convert.rollout_to_pb(rollout), created=created
        )

    async def SubmitRollouts(
        self, request: fleet_pb2.SubmitRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.SubmitRolloutsResponse:
        if not request.rollouts:
            raise InvalidArgument("rollouts is empty: nothing to submit")
        if len(request.rollouts) > MAX_BATCH_SUBMIT:
            raise ResourceExhausted(
                f"{len(request.rollouts)} submissions in one call, over the {MAX_BATCH_SUBMIT}: "
                "split them"
            )
        now = datetime.now(UTC)
        caller = self.core.caller()
        items = list(request.rollouts)
        # Every item converted and checked in one trip off the event loop.
        accepted = await asyncio.to_thread(self._accept_all, items, caller, now)
        batch: list[tuple[SubmitRequest, Manifest]] = []
        images: dict[str, tuple[str, str]] = {}  # (an image named twice is resolved once)
        for index, (item, (submit, parsed)) in enumerate(zip(items, accepted, strict=True)):
            try:
                manifest = await self.prepare(submit, parsed, now, item.image_upload, images)
            except FleetError as exc:
                raise in_batch(exc, index, item) from None
            batch.append((submit, manifest))
        stored = await self.core.db(
            self.core.ledger.submit_many, batch, now.timestamp(),
            self.core.config.max_active_per_tenant,
        )  # fmt: skip
        if any(created for _, created in stored):
            self.core.changed()
        log.info("rollouts_submitted", count=len(stored),
                 created=sum(1 for _, created in stored if created))  # fmt: skip
        return fleet_pb2.SubmitRolloutsResponse(
            rollouts=[fleet_pb2.SubmittedRollout(id=rid, created=c) for rid, c in stored]
        )

    def _accept_all(
        self, items: list[fleet_pb2.SubmitRolloutRequest], caller: Caller, now: datetime
    ) -> list[tuple[SubmitRequest, ParsedSmolfile]]:
        """A batch's submissions, each converted and checked (see `_accept`); the first that
        is refused refuses the batch, named by its place in it."""
        out = []
        for index, item in enumerate(items):
            try:
                if len(item.steps) > MAX_STEPS:
                    raise ResourceExhausted(f"the plan has {len(item.steps)} steps, over the "
                                            f"{MAX_STEPS}")  # fmt: skip
                item.tenant = caller.tenant_for(item.tenant)
                check_priority(caller, item.priority)
                out.append(self._accept(item, now))
            except FleetError as exc:
                raise in_batch(exc, index, item) from None
        return out

    def _accept(
        self, request: fleet_pb2.SubmitRolloutRequest, now: datetime
    ) -> tuple[SubmitRequest, ParsedSmolfile]:
        """A submission converted and checked (pydantic, its Smolfile's TOML): run off the event
        loop, so a large request delays no other call."""
        submit = convert.submit_from_pb(request)
        max_deadline = timedelta(seconds=self.core.config.max_deadline_s)
        return submit, validate_request(submit, now, max_deadline)

    async def prepare(
        self, submit: SubmitRequest, parsed: ParsedSmolfile, now: datetime, image_upload: str = "",
        images: dict[str, tuple[str, str]] | None = None,
    ) -> Manifest:  # fmt: skip
        """A validated submission's manifest: its inputs checked, its image pinned, its host
        class servable. `images`: (digest, pinned) of the images this request resolved already,
        by name (one resolution of an image serves a whole batch)."""
        owner = self._owner(submit.tenant)
        await self._check_inputs(submit, owner)
        image = image_of(parsed)
        pinned = ""
        if oci.looks_like_archive(image):  # on the submitter's disk: uploaded flattened
            image_digest = await self._import_upload(image_upload, image,
                                                     submit.smolfile_name, owner)  # fmt: skip
        elif images is not None and image in images:
            image_digest, pinned = images[image]
        else:
            image_digest, pinned = await self._resolve(image, submit.tenant)
            if images is not None:
                images[image] = (image_digest, pinned)
        manifest = build_manifest(submit, parsed, image_digest, now, pinned)
        reason = await self.core.unservable_reason(manifest.host_class, manifest.requirements)
        if reason:
            raise FailedPrecondition(reason)
        return manifest

    async def _resolve(self, image: str, tenant: str) -> tuple[str, str]:
        """(digest, pinned reference) of an image a registry or this server's store holds."""
        if oci.looks_like_reference(image):  # a registry's image: pinned by its digests
            return await self.resolver.resolve(tenant, image)
        return await asyncio.to_thread(self.core.images.resolve, image), ""  # (files only)

    def _owner(self, tenant: str) -> str:
        """The tenant whose uploads a call may name ("": any, for an admin key or a server
        without authentication, which act for every tenant)."""
        return "" if self.core.caller().all_tenants else tenant

    async def _owned(self, owner: str, digest: str) -> bool:
        """Where `owner` is given, that tenant uploaded the blob: a tenant names only what it
        sent (knowing another's digest reads nothing of it)."""
        if not owner:
            return True  # (whether it is there at all is the caller's next question)
        return await asyncio.to_thread(self.core.blobs.owns, owner, digest)

    async def admit(
        self, submit: SubmitRequest, parsed: ParsedSmolfile, now: datetime, image_upload: str = "",
        request_id: str = "",
    ) -> tuple[Rollout, bool]:  # fmt: skip
        """A validated submission into the ledger (see `prepare`); (the rollout, whether this
        call created it)."""
        manifest = await self.prepare(submit, parsed, now, image_upload)
        rollout, created = await self.submits.store(submit, manifest)
        log.info(
            "rollout_submitted",
            rollout_id=rollout.id,
            created=created,
            request_id=request_id,
            host_class=manifest.host_class,
        )
        return rollout, created

    async def _import_upload(self, digest: str, image: str, where: str, owner: str) -> str:
        """The image a submitter flattened from an archive and uploaded (PutBlob), stored in
        the image store under its digest."""
        if not digest:
            raise InvalidArgument(
                f"{where}: image {image!r} is an archive on the submitter's disk: submit with "
                "the fleet CLI (it uploads the archive), or push the image to a registry"
            )
        missing = FailedPrecondition(f"image_upload {digest} was not uploaded (PutBlob)")
        if not await self._owned(owner, digest):
            raise missing
        try:
            blob = await asyncio.to_thread(self.core.blobs.local_path, digest)
        except NotFound:
            raise missing from None
        await asyncio.to_thread(self.core.images.add_blob, digest, blob)
        return digest

    async def _check_inputs(self, submit: SubmitRequest, owner: str) -> None:
        """Every input was uploaded (by `owner`, where given), with the size the request
        states, within the limit. Another tenant's blob answers as a missing one does."""
        total = 0
        for index, item in enumerate(submit.inputs):
            missing = FailedPrecondition(
                f"inputs[{index}] ({item.path}): blob {item.digest} was not uploaded "
                "(PutBlob it first)"
            )
            if not await self._owned(owner, item.digest):
                raise missing
            try:
                size = await asyncio.to_thread(self.core.blobs.size, item.digest)
            except NotFound:
                raise missing from None
            if size != item.size:
                raise InvalidArgument(
                    f"inputs[{index}] ({item.path}): size {item.size} but the blob holds {size}"
                )
            total += size
        limit = self.core.config.max_input_mib * MIB
        if total > limit:
            raise ResourceExhausted(
                f"inputs: {total / MIB:.1f} MiB together, over the limit of "
                f"{self.core.config.max_input_mib:g} MiB (fleet serve --max-input-mib)"
            )

    async def PutBlob(
        self, requests: AsyncIterator[fleet_pb2.BlobPart], context: grpc.aio.ServicerContext
    ) -> fleet_pb2.PutBlobResponse:
        caller = self.core.caller()
        owner = "" if caller.all_tenants else caller.tenant

        async def parts() -> AsyncIterator[bytes]:
            async for part in requests:
                yield part.data

        limit = int(self.core.config.max_input_mib * MIB)
        digest, size = await self.core.blobs.put(
            parts(), limit, "an input (fleet serve --max-input-mib)", owner=owner,
            quota_bytes=self.quota_bytes if owner else 0,
        )  # fmt: skip
        log.info("blob_stored", digest=digest, size=size, key_id=caller.key_id, tenant=owner)
        return fleet_pb2.PutBlobResponse(digest=digest, size=size)

    async def GetArtifact(
        self, request: fleet_pb2.GetArtifactRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[fleet_pb2.ArtifactChunk]:
        rollout = await self.core.read(self.core.ledger.get, request.rollout_id)
        self.core.caller().check_owner(request.rollout_id, rollout.tenant)
        known = {i.digest for i in rollout.manifest.inputs}
        known |= {o.digest for o in rollout.outputs if o.digest}
        if request.digest not in known:
            raise NotFound(f"rollout {request.rollout_id} has no artifact {request.digest}")
        async for offset, data, total in self.core.blobs.chunks(request.digest, request.offset):
            yield fleet_pb2.ArtifactChunk(offset=offset, data=data, total_size=total)

    async def GetRollout(
        self, request: fleet_pb2.GetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> types_pb2.Rollout:
        rollout = await self.core.read(self.core.ledger.get, request.id)
        self.core.caller().check_owner(request.id, rollout.tenant)
        return convert.rollout_to_pb(rollout)

    async def _check_owner(self, rollout_id: str) -> None:
        caller = self.core.caller()
        if not caller.all_tenants:
            rollout = await self.core.read(self.core.ledger.get, rollout_id)
            caller.check_owner(rollout_id, rollout.tenant)

    async def ListRollouts(
        self, request: fleet_pb2.ListRolloutsRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.ListRolloutsResponse:
        caller = self.core.caller()
        rollouts, token = await self.core.read(
            functools.partial(
                self.core.ledger.list_rollouts,
                tenant=None if caller.all_tenants else caller.tenant,
            ),
            request.page_size,
            request.page_token,
            dict(request.labels),
            request.could_reach.strip(),
        )
        page: list[types_pb2.Rollout] = []
        size = 0
        for rollout in rollouts:
            pb = convert.rollout_to_pb(rollout)
            size += pb.ByteSize()
            if page and size > MAX_LIST_BYTES:
                # A client's default receive limit is 4 MiB: end the page early instead.
                token = await self.core.read(self.core.ledger.page_token_at, page[-1].id)
                break
            page.append(pb)
        return fleet_pb2.ListRolloutsResponse(rollouts=page, next_page_token=token)

    async def WatchRollout(
        self, request: fleet_pb2.WatchRolloutRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[types_pb2.RolloutEvent]:
        after = request.after_sequence
        if after < 0:
            raise InvalidArgument("after_sequence is negative")
        await self._check_owner(request.id)
        page = 500
        while True:
            # The state first, then the events: a rollout read as final has written all its
            # events, so a stream that ends here has sent them all. (Read the other way round,
            # a rollout that turned final between the two reads ended the stream early.)
            rollout = await self.core.read(self.core.ledger.get, request.id)
            events = await self.core.read(self.core.ledger.events, request.id, after, page)
            for e in events:
                after = e.sequence
                yield convert.event_to_pb(e)
            if rollout.state.final and len(events) < page:
                return
            if not events:
                await self.core.event_pulse.wait(1.0)

    async def CancelRollout(
        self, request: fleet_pb2.CancelRolloutRequest, context: grpc.aio.ServicerContext
    ) -> types_pb2.Rollout:
        await self._check_owner(request.id)
        caller = self.core.caller()
        actor = f"request:{request.request_id}" if request.request_id else "client"
        if caller.key_id:
            actor += f" key:{caller.key_id}"
        rollout = await self.core.db(
            self.core.ledger.cancel, request.id, request.reason, actor, time.time()
        )
        self.core.changed()
        return convert.rollout_to_pb(rollout)

    async def ListEgressEvents(
        self, request: fleet_pb2.ListEgressEventsRequest, context: grpc.aio.ServicerContext
    ) -> fleet_pb2.ListEgressEventsResponse:
        if not request.rollout_id:
            raise InvalidArgument("rollout_id is empty")
        await self._check_owner(request.rollout_id)
        rows = await self.core.read(self.core.ledger.egress_events, request.rollout_id)
        return fleet_pb2.ListEgressEventsResponse(
            events=[convert.egress_event_to_pb(e, request.rollout_id, a) for a, e in rows]
        )
