"""`AsyncFleet.admin`: the operator's calls (AdminService) over the fleet's own connection;
`Fleet.admin` (`fleet.client.sync`) runs these same calls, blocking.

They need a key with the admin scope; any other is refused with `PermissionDenied`. The
answers are AdminService's messages (`fleet.api.pb.admin_pb2`), whose times are seconds since
the epoch with 0 for none.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from fleet.api import admin_convert
from fleet.api.convert import HOST_CLASS_TO_PB, RUNTIME_TO_PB
from fleet.api.pb import admin_pb2, admin_pb2_grpc
from fleet.core.errors import InvalidArgument
from fleet.core.placement import HostClass, Pool, RuntimeKind
from fleet.core.report import Report

P = ParamSpec("P")
T = TypeVar("T")


class Connection(Protocol):
    """What the admin calls use of `AsyncFleet`: its channel (opened on first use) and its
    call wrapper (retries, fleet's own errors)."""

    _channel: Any

    @property
    def rollouts_stub(self) -> Any: ...

    async def call(self, fn: Callable[[], Awaitable[Any]]) -> Any: ...


class AsyncAdmin:
    """Hosts, join tokens, tenants' API keys, pools, the rollback and the cost report, as
    `fleet host|key|pool|rollback|report` manage them."""

    def __init__(self, fleet: Connection) -> None:
        self._fleet = fleet
        self._stub: Any = None
        self._on: Any = None

    @property
    def stub(self) -> Any:
        """The AdminService stub on the fleet's channel (made again after `close()`)."""
        self._fleet.rollouts_stub  # (opens the channel when none is open)  # noqa: B018
        channel = self._fleet._channel
        if self._stub is None or self._on is not channel:
            self._stub, self._on = admin_pb2_grpc.AdminServiceStub(channel), channel
        return self._stub

    async def _call(self, rpc: str, request: Any) -> Any:
        return await self._fleet.call(lambda: getattr(self.stub, rpc)(request, timeout=30))

    # -- hosts -----------------------------------------------------------------------------------

    async def hosts(self, unresponsive_after_s: float = 0.0) -> list[admin_pb2.HostInfo]:
        """Registered hosts: state, version, slots, last beat (0: unresponsive after 15 s)."""
        request = admin_pb2.ListHostsRequest(unresponsive_after_s=unresponsive_after_s)
        return list((await self._call("ListHosts", request)).hosts)

    async def cordon(self, host_id: str) -> admin_pb2.HostStateResponse:
        reply: admin_pb2.HostStateResponse = await self._call(
            "CordonHost", admin_pb2.HostRequest(host_id=host_id))  # fmt: skip
        return reply

    async def uncordon(self, host_id: str) -> admin_pb2.HostStateResponse:
        reply: admin_pb2.HostStateResponse = await self._call(
            "UncordonHost", admin_pb2.HostRequest(host_id=host_id))  # fmt: skip
        return reply

    async def drain(self, host_id: str, deadline_s: float = 600.0) -> admin_pb2.HostStateResponse:
        """No new work for the host; what it holds runs `deadline_s` more, then is released
        for retry elsewhere."""
        if deadline_s <= 0:
            raise InvalidArgument(f"drain deadline_s {deadline_s}: must be more than 0")
        request = admin_pb2.DrainHostRequest(host_id=host_id, deadline=time.time() + deadline_s)
        reply: admin_pb2.HostStateResponse = await self._call("DrainHost", request)
        return reply

    async def revoke_host(self, host_id: str) -> admin_pb2.RevokeHostResponse:
        reply: admin_pb2.RevokeHostResponse = await self._call(
            "RevokeHost", admin_pb2.HostRequest(host_id=host_id))  # fmt: skip
        return reply

    # -- join tokens -----------------------------------------------------------------------------

    async def create_join_token(
        self, host_class: HostClass | str = HostClass.CPU, *, labels: Mapping[str, str] = {},
        ttl_s: float = 3600.0, uses: int = 1, runtimes: Iterable[RuntimeKind] = (),
    ) -> admin_pb2.CreateJoinTokenResponse:  # fmt: skip
        """A join token (its `secret` is shown once) and the CA fingerprint hosts pin."""
        request = admin_pb2.CreateJoinTokenRequest(
            host_class=HOST_CLASS_TO_PB[HostClass(host_class)], labels=dict(labels),
            ttl_s=ttl_s, uses=uses, runtimes=[RUNTIME_TO_PB[r] for r in runtimes],
        )  # fmt: skip
        reply: admin_pb2.CreateJoinTokenResponse = await self._call("CreateJoinToken", request)
        return reply

    async def join_tokens(self) -> list[admin_pb2.JoinTokenInfo]:
        return list((await self._call("ListJoinTokens", admin_pb2.ListJoinTokensRequest())).tokens)

    async def revoke_join_token(self, token_id: str) -> None:
        await self._call("RevokeJoinToken", admin_pb2.RevokeRequest(id=token_id))

    # -- API keys --------------------------------------------------------------------------------

    async def create_key(
        self, tenant: str, scopes: Iterable[str] = ("rollouts:read", "rollouts:write"),
        expires_at: float | None = None,
    ) -> admin_pb2.CreateKeyResponse:  # fmt: skip
        """A tenant's API key; its `secret` is shown once (the ledger keeps only its hash)."""
        request = admin_pb2.CreateKeyRequest(
            tenant=tenant, scopes=list(scopes), expires_at=admin_convert.when(expires_at)
        )
        reply: admin_pb2.CreateKeyResponse = await self._call("CreateKey", request)
        return reply

    async def keys(self, tenant: str = "") -> list[admin_pb2.KeyInfo]:
        return list((await self._call("ListKeys", admin_pb2.ListKeysRequest(tenant=tenant))).keys)

    async def revoke_key(self, key_id: str) -> None:
        await self._call("RevokeKey", admin_pb2.RevokeRequest(id=key_id))

    # -- pools -----------------------------------------------------------------------------------

    async def set_pool(self, pool: Pool) -> Pool:
        """Makes or changes a pool; claims see it at once, on every server."""
        request = admin_pb2.SetPoolRequest(pool=admin_convert.pool_to_pb(pool))
        return admin_convert.pool_from_pb((await self._call("SetPool", request)).pool)

    async def pools(self) -> list[admin_pb2.PoolInfo]:
        return list((await self._call("ListPools", admin_pb2.ListPoolsRequest())).pools)

    async def delete_pool(self, name: str) -> None:
        await self._call("DeletePool", admin_pb2.DeletePoolRequest(name=name))

    async def pool_events(
        self, window_s: float = 3600.0, pool: str = "", limit: int = 0
    ) -> list[admin_pb2.PoolEvent]:
        """Pools paused, resumed and caps moved in the last `window_s`, oldest first, with
        the figures that moved them (`pool`: one pool's only; at most `limit`, the newest, 0
        or more than 1000 for 1000)."""
        request = admin_pb2.ListPoolEventsRequest(window_s=window_s, pool=pool, limit=limit)
        return list((await self._call("ListPoolEvents", request)).events)

    # -- rollback to the local pool --------------------------------------------------------------

    async def rollback(
        self, deadline_s: float = 600.0, local_pool: str = ""
    ) -> admin_pb2.RollbackResponse:
        """Rolls back to the local pool (`local_pool`, or `fleet up`'s agents and the gpu
        hosts): every other host drains, what it still runs after `deadline_s` is retried
        locally. The reply names the hosts set draining and the deadline; refused while a
        rollback is in force."""
        if deadline_s <= 0:
            raise InvalidArgument(f"rollback deadline_s {deadline_s}: must be more than 0")
        request = admin_pb2.RollbackRequest(deadline=time.time() + deadline_s,
                                            local_pool=local_pool)  # fmt: skip
        reply: admin_pb2.RollbackResponse = await self._call("Rollback", request)
        return reply

    async def undo_rollback(self) -> list[str]:
        """Ends the rollback in force; returns the hosts it had drained, ready again."""
        return list((await self._call("UndoRollback", admin_pb2.UndoRollbackRequest())).hosts)

    async def rollback_state(self) -> dict[str, Any] | None:
        """{"since": time, "local_pool": name or ""} while a rollback is in force, else None
        (as the ledger says it)."""
        reply = await self._call("GetRollback", admin_pb2.GetRollbackRequest())
        return {"since": reply.since, "local_pool": reply.local_pool} if reply.in_force else None

    # -- the cost report -------------------------------------------------------------------------

    async def report(
        self, window_s: float = 3600.0, *, by_label: str = "",
        prices: Mapping[str, float] | None = None,
    ) -> Report:  # fmt: skip
        """What completed trajectories cost over the last `window_s`, by pool (or by the
        rollout label `by_label`), priced at `prices` (None: the server's)."""
        request = admin_pb2.ReportRequest(window_s=window_s, by_label=by_label,
                                          prices=dict(prices or {}))  # fmt: skip
        return admin_convert.report_from_pb(await self._call("Report", request))


class Runner(Protocol):
    """What runs a coroutine to its end for a blocking caller (`Fleet`'s loop thread)."""

    def __call__(self, coro: Coroutine[Any, Any, T]) -> T: ...


def _blocking(
    call: Callable[Concatenate[AsyncAdmin, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Admin, P], T]:
    """`AsyncAdmin`'s call, run to its end: the same request, the same answer and errors."""

    def run(self: Admin, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(call(self.aio, *args, **kwargs))

    functools.update_wrapper(run, call)  # (its name, signature and docstring, for help())
    return run


class Admin:
    """`Fleet.admin`: `AsyncAdmin`'s calls, blocking (each runs on the client's own loop)."""

    def __init__(self, aio: AsyncAdmin, run: Runner) -> None:
        self.aio = aio
        self._run = run

    hosts = _blocking(AsyncAdmin.hosts)
    cordon = _blocking(AsyncAdmin.cordon)
    uncordon = _blocking(AsyncAdmin.uncordon)
    drain = _blocking(AsyncAdmin.drain)
    revoke_host = _blocking(AsyncAdmin.revoke_host)
    create_join_token = _blocking(AsyncAdmin.create_join_token)
    join_tokens = _blocking(AsyncAdmin.join_tokens)
    revoke_join_token = _blocking(AsyncAdmin.revoke_join_token)
    create_key = _blocking(AsyncAdmin.create_key)
    keys = _blocking(AsyncAdmin.keys)
    revoke_key = _blocking(AsyncAdmin.revoke_key)
    set_pool = _blocking(AsyncAdmin.set_pool)
    pools = _blocking(AsyncAdmin.pools)
    delete_pool = _blocking(AsyncAdmin.delete_pool)
    pool_events = _blocking(AsyncAdmin.pool_events)
    rollback = _blocking(AsyncAdmin.rollback)
    undo_rollback = _blocking(AsyncAdmin.undo_rollback)
    rollback_state = _blocking(AsyncAdmin.rollback_state)
    report = _blocking(AsyncAdmin.report)
