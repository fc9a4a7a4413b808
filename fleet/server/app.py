"""The fleet server: FleetService, SessionService, HostService and AdminService over one
ledger, health and reflection on."""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fleet.api.interceptor import ApiInterceptor
from fleet.api.pb import (
    admin_pb2,
    admin_pb2_grpc,
    fleet_pb2,
    fleet_pb2_grpc,
    host_pb2,
    host_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
)
from fleet.console.session_calls import SessionAccess
from fleet.console.web import Backend, Console, console_address
from fleet.console.web import serve as serve_console
from fleet.core import tokens
from fleet.core.beat_pace import COUNT_AT_START_S
from fleet.core.errors import (
    FailedPrecondition,
)
from fleet.core.sweep_clock import SweepClock
from fleet.identity.tls import (
    ServerTls,
    is_loopback,
    server_names,
    server_ssl_context,
    split_address,
)
from fleet.image.store import ImageStore
from fleet.ledger.retention import purge_finished, referenced_blobs
from fleet.ledger.store import Ledger
from fleet.server.admin_service import AdminServicer
from fleet.server.auth import CALLER, SCOPE_OF, Caller, Security
from fleet.server.core import (
    DEFAULT_HOST_PORT,
    Core,
)
from fleet.server.fleet_service import FleetServicer
from fleet.server.host_service import HostServicer
from fleet.server.metrics import serve_metrics
from fleet.server.sessions import SessionServicer
from fleet.server.settings import ServerConfig as ServerConfig  # (re-exported: callers build it)

log = structlog.get_logger(__name__)

PACE_REFRESH_S = 5.0
"""How often the live hosts are counted for the heartbeat pace (`fleet.core.beat_pace`)."""

__all__ = ["Core", "FleetServer", "ServerConfig"]


async def _sweeper(core: Core) -> None:
    late_at = 0.0  # (monotonic: when queued work past its deadline is next looked for)
    paced_at = time.monotonic()
    try:  # (the longest lease its hosts may hold: see COUNT_AT_START_S)
        await core.refresh_pace(COUNT_AT_START_S)
    except Exception:
        log.exception("pace_failed")
    clock = SweepClock(core.config.sweep_interval_s, core.pace.lease_ttl_s)
    hold_s = core.pace.lease_ttl_s
    held_since = time.time()
    # Its hosts get a lease of this server's own time to reach it before their leases are
    # judged; the leases of hosts that reached it since the hold began are judged as usual.
    log.info("sweeper_holding_after_start", hold_s=hold_s)
    due_since = time.time()
    while True:
        try:
            if time.monotonic() - paced_at >= PACE_REFRESH_S:
                paced_at = time.monotonic()
                clock.lease_ttl_s = (await core.refresh_pace()).lease_ttl_s
            wall = time.time()
            # Retries whose backoff ended: no submission woke a claim for them (each replica
            # wakes its own waiting claims).
            due = await core.read(core.ledger.retries_due, due_since, wall)
            due_since = wall
            if due:
                core.work_pulse.fire(due)
            now = clock.now(wall)  # (not counting time this server was not running)
            if clock.late_s:
                held_since = wall  # (no host could reach it while it was paused)
                log.warning("sweeper_resumed_late", late_s=round(clock.late_s, 3), hold_s=hold_s)
            if now is None:  # (holding: see SweepClock)
                seen = functools.partial(core.ledger.sweep, late=False, seen_since=held_since)
                if await core.db(seen, wall):
                    core.changed()
            else:
                late = time.monotonic() >= late_at
                if late:
                    late_at = time.monotonic() + core.config.late_sweep_interval_s
                if await core.db(functools.partial(core.ledger.sweep, late=late), now):
                    core.changed()
                for host_id, released in await core.db(core.ledger.drain_sweep, now):
                    log.info("host_drained", host_id=host_id, leases_released=released)
                    if released:
                        core.changed()
        except Exception:
            log.exception("sweep_failed")
        await asyncio.sleep(core.config.sweep_interval_s)


async def _govern(core: Core) -> None:
    """Pools' promotion gates and adaptive caps, judged every `govern_interval_s` in the ledger
    (so replicas take turns): each pause, resume and cap moved is an event and a log line."""
    while True:
        try:
            events = await core.db(
                core.ledger.govern, time.time(), core.gateway_p95_ms,
                core.gateway_queue_age_ms, core.gateway_saturated,
            )  # fmt: skip
            for e in events:
                core.pool_events[(e.pool, e.kind)] = core.pool_events.get((e.pool, e.kind), 0) + 1
                log.info(f"pool_{e.kind}", pool=e.pool, cap=e.cap, why=e.message,
                         figures=e.figures)  # fmt: skip
            if any(e.kind in ("resumed", "raised") for e in events):
                core.changed()  # claims waiting for room look again
        except Exception:
            log.exception("govern_failed")
        await asyncio.sleep(core.config.govern_interval_s)


async def _retention(core: Core) -> None:
    """Deletes rollouts (and their files) that ended more than `retain_days` ago."""
    while True:
        try:
            cutoff = time.time() - core.config.retain_days * 86400
            removed = await core.db(purge_finished, core.ledger, cutoff)
            keep = await core.read(referenced_blobs, core.ledger)  # (reads every manifest)
            blobs = await asyncio.to_thread(core.blobs.collect_garbage, keep, cutoff)
            if removed or blobs:
                log.info("retention", rollouts_removed=removed, blobs_removed=blobs,
                         retain_days=core.config.retain_days)  # fmt: skip
        except Exception:
            log.exception("retention_failed")
        await asyncio.sleep(core.config.retention_interval_s)


async def _status_request(
    core: Core, charged: inference_pb2.UsageMark | None = None
) -> inference_pb2.GatewayStatusRequest:
    """A status poll that tells the gateway which rollouts that call it are running (signed
    with the token secret): their tokens are good, the others' are not. `charged`: the last
    hand-over of usage this server charged (the gateway hands the rest again)."""
    secret = core.config.token_secret
    if not secret:
        return inference_pb2.GatewayStatusRequest()
    as_of = time.time()  # before the read: whatever was leased by then is in it
    running = await core.read(core.ledger.running_rollouts, core.inference_running)
    core.inference_running = running
    ids = sorted(rollout for rollout, uses in running.items() if uses)
    return inference_pb2.GatewayStatusRequest(
        running=inference_pb2.RunningRollouts(
            rollout_ids=ids, as_of=as_of, signature=tokens.sign_running(secret, ids, as_of)
        ),
        charged=charged if charged is not None else inference_pb2.UsageMark(),
    )


async def _charge(
    core: Core, status: inference_pb2.GatewayStatus, charged: inference_pb2.UsageMark
) -> inference_pb2.UsageMark:
    """Charges the device seconds and tokens a poll was handed to the rollouts' attempts, in
    one transaction; returns the mark to confirm with the next poll. When the charge fails the
    old mark is kept, so the gateway hands the same figures again (with what came since)."""
    if not status.HasField("usage_mark"):  # (a gateway that numbers nothing: taken once)
        if status.device_seconds:
            await core.db(core.ledger.add_device_seconds, dict(status.device_seconds))
        return charged
    used = {
        rollout: {c.model: (int(c.prompt), int(c.completion)) for c in counts.counts}
        for rollout, counts in status.tokens.items()
    }
    try:
        await core.db(core.ledger.add_usage, dict(status.device_seconds), used)
    except Exception as exc:  # (the ledger is unreachable, say: the gateway keeps them)
        log.warning("gateway_usage_not_charged", error=f"{type(exc).__name__}: {exc}",
                    effect="the gateway hands them again with the next poll")  # fmt: skip
        return charged
    return status.usage_mark


async def _watch_gateway(core: Core) -> None:
    """Backpressure: holds rollouts that call the gateway while its queue is too deep.

    Over `backpressure_queue_depth` they stay queued (CPU-only work goes on); they start again
    once the queue is down to `backpressure_resume_depth`. An unreachable gateway holds them too.
    """
    config = core.config
    host, _ = split_address(config.gateway_address)
    if core.security is not None and not is_loopback(host):
        # Beyond loopback the gateway serves TLS with a certificate from the same CA.
        credentials = grpc.ssl_channel_credentials(root_certificates=core.security.ca.pem)
        channel = grpc.aio.secure_channel(config.gateway_address, credentials)
    else:
        channel = grpc.aio.insecure_channel(config.gateway_address)
    async with channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        charged = inference_pb2.UsageMark()  # (none charged yet by this server)
        while True:
            before = core.hold_inference
            try:
                status = await stub.Status(
                    await _status_request(core, charged), timeout=max(1.0, config.gateway_poll_s)
                )
                depth = int(status.queue_depth)
                core.gateway_queue_depth = depth
                core.gateway_p95_ms = status.p95_latency_ms
                core.gateway_queue_age_ms = status.oldest_queued_ms
                if depth >= config.backpressure_queue_depth:
                    core.hold_inference = True
                elif depth <= config.backpressure_resume_depth:
                    core.hold_inference = False
                why = f"gateway queue depth {depth}"
                core.gateway_saturated = (
                    f"the gateway's queue is over its backpressure depth ({depth} >= "
                    f"{config.backpressure_queue_depth})" if core.hold_inference else ""
                )  # fmt: skip
                charged = await _charge(core, status, charged)
            except grpc.aio.AioRpcError as exc:
                core.hold_inference = True
                core.gateway_p95_ms = core.gateway_queue_age_ms = None  # not known: not judged
                core.gateway_saturated = ""
                why = f"gateway unreachable: {exc.code().name}"
            if core.hold_inference != before:
                log.info("backpressure", hold_inference=core.hold_inference, reason=why)
                if not core.hold_inference:
                    core.changed()  # wake claims waiting for work
            await asyncio.sleep(config.gateway_poll_s)


def fleet_services() -> list[str]:
    """The full names of the services a fleet server serves: each is in reflection, and each
    answers health checks by its name."""
    return [
        fleet_pb2.DESCRIPTOR.services_by_name["FleetService"].full_name,
        fleet_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name,
        host_pb2.DESCRIPTOR.services_by_name["HostService"].full_name,
        admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    ]


class FleetServer:
    """A running server: `await start()`, then `await stop()`."""

    def __init__(
        self,
        ledger: Ledger,
        images: ImageStore,
        listen: str = "127.0.0.1:0",
        config: ServerConfig | None = None,
        security: Security | None = None,
        console_listen: str = "",
    ) -> None:
        self.config = config or ServerConfig()
        self.security = security
        self.core = Core(ledger, images, self.config, security)
        self.host_servicer = HostServicer(self.core)
        self.session_servicer = SessionServicer(self.core, self.core.sessions)
        self.fleet_servicer = FleetServicer(self.core)
        """The host API (its group commits: claims, completions, checkpoints)."""
        self.listen = listen
        self.port = 0
        self.tls: ServerTls | None = None
        self._server: grpc.aio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._mover: asyncio.Task[None] | None = None
        """Parks the sessions of draining hosts and resumes them elsewhere."""
        self._watcher: asyncio.Task[None] | None = None
        self._retention: asyncio.Task[None] | None = None
        self._governor: asyncio.Task[None] | None = None
        self._metrics: asyncio.Server | None = None
        self.metrics_port = 0
        self.console_listen = console_listen
        """host:port (or a port on loopback) of the web console ("": none)."""
        self._console: asyncio.Server | None = None
        self.console_port = 0

    @property
    def address(self) -> str:
        host = self.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    @property
    def host_address(self) -> str:
        """Where hosts call HostService: the mutual-TLS endpoint, or the API's without TLS."""
        if self.security is None:
            return self.address
        host, _ = split_address(self._host_listen())
        return f"{host}:{self.core.host_port}"

    def _host_listen(self) -> str:
        assert self.security is not None
        if self.security.host_listen:
            return self.security.host_listen
        host, port = split_address(self.listen)
        return f"{host}:{DEFAULT_HOST_PORT if port else 0}"

    async def start(self) -> None:
        limit = self.config.max_message_bytes
        # One interceptor names, authenticates and maps the errors of every call.
        auth = self.core.auth
        interceptors = [ApiInterceptor(auth.authenticate if auth is not None else None)]
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit * 4),
            ],
            interceptors=interceptors,
        )
        fleet_pb2_grpc.add_FleetServiceServicer_to_server(self.fleet_servicer, server)
        host_pb2_grpc.add_HostServiceServicer_to_server(self.host_servicer, server)
        sessions = self.session_servicer
        fleet_pb2_grpc.add_SessionServiceServicer_to_server(sessions, server)
        admin_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(self.core), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        services = fleet_services()
        reflection.enable_server_reflection(
            [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME],
            server,
        )  # fmt: skip
        if self.security is None:
            self.port = server.add_insecure_port(self.listen)
            log.warning(
                "server_insecure", listen=self.listen,
                note="no TLS and no authentication: any caller that reaches this port may act "
                "as any tenant or host",
            )  # fmt: skip
        else:
            host_listen = self._host_listen()
            also = [*self.security.san, split_address(host_listen)[0]]
            if self.console_listen:  # (the console serves the same certificate)
                also.append(console_address(self.console_listen)[0])
            names = server_names(self.listen, also)
            self.tls = ServerTls.issue(self.security.ca, names)
            self.port = server.add_secure_port(
                self.listen, self.tls.credentials(require_client_cert=False)
            )
            self.core.host_port = server.add_secure_port(
                host_listen, self.tls.credentials(require_client_cert=True)
            )
            if self.core.host_port == 0:
                raise FailedPrecondition(f"cannot listen on {host_listen} (host endpoint)")
        if self.port == 0:
            raise FailedPrecondition(f"cannot listen on {self.listen}")
        await server.start()
        for name in ["", *services]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        self._sweeper = asyncio.create_task(_sweeper(self.core))
        self._mover = asyncio.create_task(sessions.moves.move_drained_forever())
        if self.config.govern_interval_s > 0:
            self._governor = asyncio.create_task(_govern(self.core))
        if self.config.retain_days > 0:
            self._retention = asyncio.create_task(_retention(self.core))
        if self.config.gateway_address:
            self._watcher = asyncio.create_task(_watch_gateway(self.core))
        if self.config.metrics_listen:
            host, _, port = self.config.metrics_listen.rpartition(":")
            self._metrics, self.metrics_port = await serve_metrics(self.core, host, int(port))
        if self.console_listen:
            await self.start_console(self.console_listen)
        log.info("server_started", address=self.address, tls=self.security is not None,
                 host_address=self.host_address)  # fmt: skip

    async def stop(self, grace_s: float = 1.0) -> None:
        for task in (self._sweeper, self._mover, self._watcher, self._retention, self._governor):
            if task is not None:
                task.cancel()
        if self._metrics is not None:
            self._metrics.close()
        if self._console is not None:
            self._console.close()
        if self._server:
            await self._server.stop(grace_s)
        self.core.close()
        log.info("server_stopped", address=self.address)

    async def start_console(self, listen: str) -> int:
        """The web console (`fleet.console`) on `listen`, reading this server's ledger; over
        the API's TLS certificate when the server has one, and beyond loopback only then.
        Returns its port."""
        host, port = console_address(listen)
        if self.tls is None and not is_loopback(host):
            raise FailedPrecondition(
                f"--console-listen {listen}: beyond loopback the console needs TLS, and this "
                "server has none (start it with the fleet CA: fleet ca init, or --tls)"
            )
        core = self.core
        # The console's session actions are the SessionServicer's own calls, made as the
        # signed-in key: the caller the servicer reads is set as the authenticator sets it.
        access = SessionAccess(self.session_servicer, SCOPE_OF, lambda tenant, scopes, key_id:
                               CALLER.set(Caller("tenant", tenant=tenant, scopes=scopes,
                                                 key_id=key_id)))  # fmt: skip
        backend = Backend(core.ledger, core.read, core.db, core.blobs.chunks, core.changed,
                          access)  # fmt: skip
        console = Console(backend, self.config.token_secret, tls=self.tls is not None)
        ssl = server_ssl_context(self.tls) if self.tls is not None else None
        self._console, self.console_port = await serve_console(console, host, port, ssl)
        return self.console_port

    async def wait(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()
