"""AdminService: the operator's hosts, join tokens, API keys, pools, rollback and cost report,
over gRPC.

The operations are the ledger's, the same `fleet host|key|pool|rollback|report --db` performs
on the server's machine; served here, an operator needs only the server's address, the fleet
CA's certificate and a key with the admin scope. Every call is checked for that scope (a
tenant's key is refused with PERMISSION_DENIED) and logged with the key's id, whatever its
outcome.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
import structlog

from fleet.api import admin_convert as ac
from fleet.api.convert import HOST_CLASS_TO_PB, RUNTIME_TO_PB
from fleet.api.pb import admin_pb2, admin_pb2_grpc
from fleet.core.credentials import Scope, format_api_key, format_join_token, parse_scopes
from fleet.core.errors import FleetError, InvalidArgument, PermissionDenied
from fleet.identity.bounds import DEFAULT_RUNTIMES
from fleet.ledger.identity import ApiKey, JoinToken
from fleet.ledger.pools import MAX_EVENTS
from fleet.ledger.report import read_report
from fleet.server.auth import Caller, current
from fleet.server.core import Core

log = structlog.get_logger(__name__)

T = TypeVar("T")


def admin_caller(rpc: str) -> Caller:
    """The caller of an AdminService call, who must hold the admin scope (on a server without
    security, loopback only, everyone acts as the operator, as with `--db`)."""
    caller = current()
    if caller.kind != "open" and Scope.ADMIN not in caller.scopes:
        raise PermissionDenied(
            f"AdminService/{rpc} needs an API key with the admin scope"
            + (f" (key {caller.key_id} has: {', '.join(sorted(caller.scopes)) or 'none'})"
               if caller.key_id else "")
        )  # fmt: skip
    return caller


def _token_pb(t: JoinToken) -> admin_pb2.JoinTokenInfo:
    return admin_pb2.JoinTokenInfo(
        id=t.id, host_class=HOST_CLASS_TO_PB[t.host_class], labels=t.labels,
        runtimes=[RUNTIME_TO_PB[r] for r in sorted(t.runtimes)], uses_left=t.uses_left,
        created_at=t.created_at, expires_at=t.expires_at, revoked_at=ac.when(t.revoked_at),
    )  # fmt: skip


def _key_pb(k: ApiKey) -> admin_pb2.KeyInfo:
    return admin_pb2.KeyInfo(
        id=k.id, tenant=k.tenant, scopes=sorted(k.scopes), created_at=k.created_at,
        expires_at=ac.when(k.expires_at), last_used_at=ac.when(k.last_used_at),
        revoked_at=ac.when(k.revoked_at),
    )  # fmt: skip


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):  # type: ignore[misc]
    """Each call: the admin scope checked, the ledger's operation on its one writer thread (or
    a reader's), and one log line with the key's id and what was asked."""

    def __init__(self, core: Core) -> None:
        self.core = core

    async def _run(self, rpc: str, fields: dict[str, Any], op: Callable[[], Awaitable[T]]) -> T:
        caller = admin_caller(rpc)
        bound = log.bind(rpc=rpc, key_id=caller.key_id or "-", tenant=caller.tenant, **fields)
        try:
            result = await op()
        except FleetError as exc:
            bound.info("admin_call_refused", code=str(exc.code), reason=exc.message)
            raise
        bound.info("admin_call")
        return result

    # -- hosts -----------------------------------------------------------------------------------

    async def ListHosts(
        self, request: admin_pb2.ListHostsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListHostsResponse:
        after = request.unresponsive_after_s or self.core.pace.lease_ttl_s

        async def op() -> admin_pb2.ListHostsResponse:
            ledger = self.core.ledger
            views = await self.core.read(ledger.host_table, time.time(), after)
            enrolled = {h.host_id: h for h in await self.core.read(ledger.identities.hosts)}
            out = admin_pb2.ListHostsResponse()
            for view in views:
                caps = view.capabilities
                identity = enrolled.get(caps.host_id)
                out.hosts.append(admin_pb2.HostInfo(
                    host_id=caps.host_id, host_class=HOST_CLASS_TO_PB[caps.host_class],
                    state=view.state, agent_version=caps.agent_version, slots=caps.slots,
                    slots_used=view.slots_used, last_heartbeat_at=view.last_heartbeat_at,
                    cert_expires_at=identity.cert_expires_at if identity else 0.0,
                    labels=identity.labels if identity else caps.labels, images=view.images,
                ))  # fmt: skip
            return out

        return await self._run("ListHosts", {}, op)

    async def _set_state(
        self, rpc: str, host_id: str, state: str, deadline: float | None = None
    ) -> admin_pb2.HostStateResponse:
        async def op() -> admin_pb2.HostStateResponse:
            if not host_id:
                raise InvalidArgument(f"{rpc}: host_id is empty")
            if deadline is not None and deadline <= time.time():
                raise InvalidArgument(
                    f"DrainHostRequest.deadline {deadline:.0f}: must be in the future "
                    "(seconds since the epoch)"
                )
            await self.core.db(
                lambda: self.core.ledger.set_host_state(host_id, state, drain_deadline=deadline)
            )
            self.core.changed()  # (claims waiting for room look again)
            return admin_pb2.HostStateResponse(
                host_id=host_id, state=state, drain_deadline=ac.when(deadline)
            )

        return await self._run(rpc, {"host_id": host_id, "deadline": deadline}, op)

    async def CordonHost(
        self, request: admin_pb2.HostRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.HostStateResponse:
        return await self._set_state("CordonHost", request.host_id, "cordoned")

    async def UncordonHost(
        self, request: admin_pb2.HostRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.HostStateResponse:
        return await self._set_state("UncordonHost", request.host_id, "ready")

    async def DrainHost(
        self, request: admin_pb2.DrainHostRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.HostStateResponse:
        return await self._set_state("DrainHost", request.host_id, "draining", request.deadline)

    async def RevokeHost(
        self, request: admin_pb2.HostRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RevokeHostResponse:
        host_id = request.host_id

        async def op() -> admin_pb2.RevokeHostResponse:
            released = await self.core.db(self.core.ledger.identities.revoke_host, host_id,
                                          time.time())  # fmt: skip
            if released:
                self.core.changed()
            return admin_pb2.RevokeHostResponse(host_id=host_id, leases_released=released)

        return await self._run("RevokeHost", {"host_id": host_id}, op)

    # -- join tokens -----------------------------------------------------------------------------

    async def CreateJoinToken(
        self, request: admin_pb2.CreateJoinTokenRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.CreateJoinTokenResponse:
        async def op() -> admin_pb2.CreateJoinTokenResponse:
            host_class = ac.host_class(request.host_class, "CreateJoinTokenRequest.host_class")
            runtimes = ac.runtimes(request.runtimes, "CreateJoinTokenRequest.runtimes")
            token, presented = await self.core.db(
                lambda: self.core.ledger.identities.create_join_token(
                    host_class, dict(request.labels), request.ttl_s, request.uses or 1,
                    time.time(), runtimes=runtimes or DEFAULT_RUNTIMES,
                )
            )  # fmt: skip
            security = self.core.security
            return admin_pb2.CreateJoinTokenResponse(
                token=_token_pb(token), secret=format_join_token(presented),
                ca_fingerprint=security.ca.fingerprint if security is not None else "",
            )  # fmt: skip

        return await self._run("CreateJoinToken", {"uses": request.uses}, op)

    async def ListJoinTokens(
        self, request: admin_pb2.ListJoinTokensRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListJoinTokensResponse:
        async def op() -> admin_pb2.ListJoinTokensResponse:
            tokens = await self.core.read(self.core.ledger.identities.join_tokens)
            return admin_pb2.ListJoinTokensResponse(tokens=[_token_pb(t) for t in tokens])

        return await self._run("ListJoinTokens", {}, op)

    async def RevokeJoinToken(
        self, request: admin_pb2.RevokeRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RevokeResponse:
        async def op() -> admin_pb2.RevokeResponse:
            now = time.time()
            await self.core.db(self.core.ledger.identities.revoke_join_token, request.id, now)
            return admin_pb2.RevokeResponse(id=request.id, revoked_at=now)

        return await self._run("RevokeJoinToken", {"token_id": request.id}, op)

    # -- API keys --------------------------------------------------------------------------------

    async def CreateKey(
        self, request: admin_pb2.CreateKeyRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.CreateKeyResponse:
        async def op() -> admin_pb2.CreateKeyResponse:
            scopes = parse_scopes(",".join(request.scopes))
            key, presented = await self.core.db(
                self.core.ledger.identities.create_key, request.tenant, scopes,
                ac.optional(request.expires_at), time.time(),
            )  # fmt: skip
            return admin_pb2.CreateKeyResponse(key=_key_pb(key), secret=format_api_key(presented))

        fields = {"for_tenant": request.tenant, "scopes": ",".join(request.scopes)}
        return await self._run("CreateKey", fields, op)

    async def ListKeys(
        self, request: admin_pb2.ListKeysRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListKeysResponse:
        async def op() -> admin_pb2.ListKeysResponse:
            keys = await self.core.read(self.core.ledger.identities.keys, request.tenant or None)
            return admin_pb2.ListKeysResponse(keys=[_key_pb(k) for k in keys])

        return await self._run("ListKeys", {"for_tenant": request.tenant}, op)

    async def RevokeKey(
        self, request: admin_pb2.RevokeRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RevokeResponse:
        async def op() -> admin_pb2.RevokeResponse:
            now = time.time()
            await self.core.db(self.core.ledger.identities.revoke_key, request.id, now)
            if self.core.auth is not None:
                self.core.auth.forget()  # (refused here at once, elsewhere within the cache time)
            return admin_pb2.RevokeResponse(id=request.id, revoked_at=now)

        return await self._run("RevokeKey", {"revoked_key_id": request.id}, op)

    # -- pools -----------------------------------------------------------------------------------

    async def SetPool(
        self, request: admin_pb2.SetPoolRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.SetPoolResponse:
        async def op() -> admin_pb2.SetPoolResponse:
            pool = ac.pool_from_pb(request.pool)
            await self.core.db(self.core.ledger.set_pool, pool, time.time())
            self.core.changed()  # (a raised cap lets waiting claims through)
            return admin_pb2.SetPoolResponse(pool=ac.pool_to_pb(pool))

        return await self._run("SetPool", {"pool": request.pool.name}, op)

    async def ListPools(
        self, request: admin_pb2.ListPoolsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListPoolsResponse:
        async def op() -> admin_pb2.ListPoolsResponse:
            views = await self.core.read(self.core.ledger.pools)
            return admin_pb2.ListPoolsResponse(pools=[
                admin_pb2.PoolInfo(
                    pool=ac.pool_to_pb(v.pool), members=v.members, running=v.running,
                    slots=v.slots, paused_at=ac.when(v.paused_at), paused_why=v.paused_why,
                )
                for v in views
            ])  # fmt: skip

        return await self._run("ListPools", {}, op)

    async def DeletePool(
        self, request: admin_pb2.DeletePoolRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DeletePoolResponse:
        async def op() -> admin_pb2.DeletePoolResponse:
            await self.core.db(self.core.ledger.delete_pool, request.name)
            self.core.changed()
            return admin_pb2.DeletePoolResponse(name=request.name)

        return await self._run("DeletePool", {"pool": request.name}, op)

    async def ListPoolEvents(
        self, request: admin_pb2.ListPoolEventsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListPoolEventsResponse:
        async def op() -> admin_pb2.ListPoolEventsResponse:
            window_s = ac.window(request.window_s, "ListPoolEventsRequest.window_s")
            limit = request.limit if 0 < request.limit <= MAX_EVENTS else MAX_EVENTS
            events = await self.core.read(self.core.ledger.pool_events, time.time() - window_s,
                                          request.pool, limit)  # fmt: skip
            return admin_pb2.ListPoolEventsResponse(events=[ac.pool_event_to_pb(e) for e in events])

        return await self._run("ListPoolEvents", {"pool": request.pool}, op)

    # -- rollback to the local pool --------------------------------------------------------------

    async def Rollback(
        self, request: admin_pb2.RollbackRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.RollbackResponse:
        deadline = request.deadline

        async def op() -> admin_pb2.RollbackResponse:
            now = time.time()
            if not deadline > now:
                raise InvalidArgument(
                    f"RollbackRequest.deadline {deadline:.0f}: must be in the future "
                    "(seconds since the epoch)"
                )
            hosts = await self.core.db(self.core.ledger.rollback, deadline, now,
                                       request.local_pool)  # fmt: skip
            self.core.changed()  # (cpu work waiting for room may go to the local gpu hosts now)
            return admin_pb2.RollbackResponse(hosts=hosts, deadline=deadline,
                                              local_pool=request.local_pool)  # fmt: skip

        fields = {"deadline": deadline, "local_pool": request.local_pool}
        return await self._run("Rollback", fields, op)

    async def UndoRollback(
        self, request: admin_pb2.UndoRollbackRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UndoRollbackResponse:
        async def op() -> admin_pb2.UndoRollbackResponse:
            hosts = await self.core.db(self.core.ledger.undo_rollback)
            self.core.changed()  # (the hosts it drained take work again)
            return admin_pb2.UndoRollbackResponse(hosts=hosts)

        return await self._run("UndoRollback", {}, op)

    async def GetRollback(
        self, request: admin_pb2.GetRollbackRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetRollbackResponse:
        async def op() -> admin_pb2.GetRollbackResponse:
            state = await self.core.read(self.core.ledger.rollback_state)
            if state is None:
                return admin_pb2.GetRollbackResponse(in_force=False)
            return admin_pb2.GetRollbackResponse(
                in_force=True, since=float(state["since"]), local_pool=state.get("local_pool", "")
            )

        return await self._run("GetRollback", {}, op)

    # -- the cost report -------------------------------------------------------------------------

    async def Report(
        self, request: admin_pb2.ReportRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ReportResponse:
        async def op() -> admin_pb2.ReportResponse:
            window_s = ac.window(request.window_s, "ReportRequest.window_s")
            prices = ac.prices(request.prices, "ReportRequest.prices")
            report = await self.core.read(read_report, self.core.ledger, window_s, time.time(),
                                          request.by_label, prices)  # fmt: skip
            return ac.report_to_pb(report)

        fields = {"window_s": request.window_s, "by_label": request.by_label}
        return await self._run("Report", fields, op)
