"""An in-process fleet for tests: a real server on port 0, real agents, a SQLite ledger.

Agents run on the in-memory runtime of `fleet.testing` unless a test asks for real sandboxes
(`harness(..., runtime=namespace_runtime)`), which only a test marked `sandbox` may do: the
control plane (ledger states, leases, retries, auth, watch) needs no root to be tested.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import grpc

import fleet
from fleet.agent.agent import Agent
from fleet.agent.capabilities import RuntimeChoice, capabilities, make_runtime
from fleet.agent.config import AgentConfig
from fleet.api.pb import fleet_pb2, fleet_pb2_grpc, host_pb2, host_pb2_grpc, types_pb2
from fleet.connect import ClientAuth
from fleet.core.credentials import Scope, format_api_key, parse_scopes
from fleet.core.placement import HostClass, RuntimeKind
from fleet.identity.ca import CertificateAuthority
from fleet.identity.local import local_host_identity
from fleet.identity.tls import HostIdentityMaterial
from fleet.image.store import ImageStore
from fleet.ledger.store import Ledger
from fleet.runtime.base import Runtime
from fleet.runtime.netns import NetConfig
from fleet.server.app import FleetServer, ServerConfig
from fleet.server.auth import Security
from fleet.testing import FakeRuntime
from tests import sandbox

SECRET = b"harness-token-secret-0123456789"
NAMESPACE = RuntimeChoice(RuntimeKind.NAMESPACE, "tests run the namespace runtime")
FINAL = {
    types_pb2.ROLLOUT_STATE_QUARANTINED,
    types_pb2.ROLLOUT_STATE_SUCCEEDED,
    types_pb2.ROLLOUT_STATE_FAILED,
    types_pb2.ROLLOUT_STATE_CANCELLED,
}

RuntimeFactory = Callable[[AgentConfig], Runtime]
"""Makes each agent's runtime, from its config (every agent needs one of its own)."""


def fake_runtime(config: AgentConfig) -> Runtime:
    """The in-memory runtime (`fleet.testing.FakeRuntime` and its default script): no root,
    no sandbox; the harness's default."""
    return FakeRuntime()


def namespace_runtime(config: AgentConfig) -> Runtime:
    """The namespace runtime a real host runs, made as the agent makes it: real processes,
    files, cgroups and network namespaces. Only for tests marked `sandbox`."""
    sandbox.require_marked("the namespace runtime")
    return make_runtime(config.runtime, config.machines_dir, config.net, config.default_disk_gib)


@dataclass
class Harness:
    server: FleetServer
    images: ImageStore
    tmp: Path
    channel: grpc.aio.Channel
    fleet: fleet_pb2_grpc.FleetServiceStub
    hosts: host_pb2_grpc.HostServiceStub
    agents: dict[str, tuple[asyncio.Event, asyncio.Task[None]]] = field(default_factory=dict)
    ca: CertificateAuthority | None = None
    """The fleet CA of a secure harness (None: a server without TLS or authentication)."""
    admin_key: str = ""
    runtime: RuntimeFactory = fake_runtime
    """What each agent runs its machines on (`start_agent`'s `runtime` overrides it)."""

    def connect(self, key: str = "", *, address: str = "") -> grpc.aio.Channel:
        """A channel to the API as a client with `key` ("" : none), over TLS when secure."""
        auth = ClientAuth(self.ca.pem if self.ca else None, key)
        return auth.channel(address or self.server.address)

    def key(self, tenant: str, scopes: str = "rollouts:read,rollouts:write") -> str:
        _, presented = self.server.core.ledger.identities.create_key(
            tenant, parse_scopes(scopes), None, time.time()
        )
        return format_api_key(presented)

    def identity(self, host_id: str, host_class: HostClass = HostClass.CPU, *,
                 gateway: bool = False) -> HostIdentityMaterial:  # fmt: skip
        """A certificate for `host_id`, enrolled as a namespace host of `host_class`."""
        assert self.ca is not None
        caps = capabilities(host_id, host_class, NAMESPACE, 2).model_copy(
            update={"gateway": gateway}
        )
        return local_host_identity(
            self.ca, self.server.core.ledger, caps, self.server.address,
            self.server.core.host_port,
        )  # fmt: skip

    async def start_agent(
        self,
        host_id: str,
        host_class: HostClass,
        slots: int = 2,
        net: NetConfig | None = None,
        gateway: tuple[str, int] | None = None,
        images: ImageStore | None = None,
        image_cache_gib: float | None = None,
        gateway_ca: bytes = b"",
        registry_ca: bytes = b"",
        drain_deadline_s: float = 600.0,
        runtime: Runtime | None = None,
    ) -> Agent:
        """An agent on the server's image store, or on `images` (a host of its own); on
        `runtime` (an instance a test keeps, to script it or read its calls) in place of the
        harness's runtime factory."""
        identity = None
        if self.ca is not None:
            identity = self.identity(host_id, host_class, gateway=gateway is not None)
        config = AgentConfig(
            server=self.server.address,
            identity=identity,
            host_id=host_id,
            host_class=host_class,
            runtime=NAMESPACE,
            machines_dir=self.tmp / "machines",
            images=images or self.images,
            slots=slots,
            claim_wait_s=1.0,
            net=net,
            gateway=gateway,
            gateway_ca=gateway_ca,
            registry_ca=registry_ca,
            image_cache_gib=image_cache_gib,
            drain_deadline_s=drain_deadline_s,
        )
        # Handed its runtime, a fake-runtime agent never makes (nor needs what makes) a
        # namespace runtime.
        agent = Agent(config, runtime if runtime is not None else self.runtime(config))
        stop = asyncio.Event()
        self.agents[host_id] = (stop, asyncio.create_task(agent.run(stop)))
        await registered(self.server, host_id)
        return agent

    async def register_host(self, host_id: str, gateway: bool = False) -> None:
        """A cpu host registered by hand, for tests that drive HostService themselves."""
        caps = host_pb2.Capabilities(
            runtime=types_pb2.RUNTIME_KIND_NAMESPACE,
            isolation=types_pb2.ISOLATION_NAMESPACE,
            cpus=1,
            gateway=gateway,
        )
        await self.hosts.RegisterHost(
            host_pb2.RegisterHostRequest(
                request_id=uuid.uuid4().hex, host_id=host_id,
                host_class=types_pb2.HOST_CLASS_CPU, capabilities=caps,
                agent_version=fleet.__version__,
            )
        )  # fmt: skip

    async def stop_agent(self, host_id: str) -> None:
        stop, task = self.agents.pop(host_id)
        stop.set()
        await asyncio.wait_for(task, 30)

    async def wait_final(self, rollout_id: str, timeout_s: float = 60) -> types_pb2.Rollout:
        for _ in range(int(timeout_s / 0.05)):
            r = await self.fleet.GetRollout(fleet_pb2.GetRolloutRequest(id=rollout_id))
            if r.state in FINAL:
                return cast(types_pb2.Rollout, r)
            await asyncio.sleep(0.05)
        raise AssertionError(f"rollout {rollout_id} did not finish in {timeout_s}s")

    async def count(self) -> int:
        reply = await self.fleet.ListRollouts(fleet_pb2.ListRolloutsRequest(page_size=500))
        return len(reply.rollouts)


async def registered(server: FleetServer, host_id: str) -> None:
    """Until an agent just started has registered `host_id` with `server` (bounded: 4 s): a
    submission before then finds no host that could serve it, and is refused."""
    for _ in range(200):
        if any(h.host_id == host_id for h in await server.core.read(server.core.ledger.hosts)):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"agent {host_id} did not register")


def request(
    smolfile: str = 'image = "minimal"\n', *steps: list[str], key: str | None = None, **kw: object
) -> fleet_pb2.SubmitRolloutRequest:
    return fleet_pb2.SubmitRolloutRequest(
        request_id=uuid.uuid4().hex,
        idempotency_key=key or uuid.uuid4().hex,
        smolfile=smolfile,
        smolfile_name="test.smolfile",
        steps=[types_pb2.Step(argv=s, timeout_s=30) for s in (steps or (["true"],))],
        **kw,  # type: ignore[arg-type]
    )


async def register_cpu_host(stub: host_pb2_grpc.HostServiceStub, cpus: int = 1) -> None:
    """Registers the host behind `stub` (a host's channel) as a cpu-class namespace host."""
    caps = host_pb2.Capabilities(
        runtime=types_pb2.RUNTIME_KIND_NAMESPACE, isolation=types_pb2.ISOLATION_NAMESPACE,
        cpus=cpus,
    )  # fmt: skip
    await stub.RegisterHost(
        host_pb2.RegisterHostRequest(
            host_class=types_pb2.HOST_CLASS_CPU, capabilities=caps,
            agent_version=fleet.__version__,
        )
    )  # fmt: skip


@contextlib.asynccontextmanager
async def harness(
    tmp: Path, images: ImageStore, config: ServerConfig | None = None, *, secure: bool = False,
    host_cert_ttl_s: float = 3600.0, lease_ttl_s: float = 5.0,
    runtime: RuntimeFactory = fake_runtime,
) -> AsyncIterator[Harness]:  # fmt: skip
    """A server on loopback; `secure`: with TLS, a CA in `tmp/ca`, API keys and host
    certificates (`fleet` is then the admin key's stub, `hosts` has no certificate);
    `lease_ttl_s`: the default config's lease (short, so that lost leases expire quickly);
    `runtime`: what its agents run machines on (`namespace_runtime`: real sandboxes)."""
    ca = CertificateAuthority.init(tmp / "ca") if secure else None
    security = (
        Security(ca, host_listen="127.0.0.1:0", cache_s=0.2, host_cert_ttl_s=host_cert_ttl_s)
        if ca is not None
        else None
    )
    server = FleetServer(
        Ledger.sqlite(tmp / "ledger.sqlite3"),
        images,
        "127.0.0.1:0",
        config
        or ServerConfig(lease_ttl_s=lease_ttl_s, heartbeat_interval_s=0.5, token_secret=SECRET),
        security,
    )
    await server.start()
    admin = ""
    if ca is not None:
        _, presented = server.core.ledger.identities.create_key(
            "default", frozenset({Scope.ADMIN}), None, time.time()
        )
        admin = format_api_key(presented)
    channel = ClientAuth(ca.pem if ca else None, admin).channel(server.address)
    h = Harness(
        server,
        images,
        tmp,
        channel,
        fleet_pb2_grpc.FleetServiceStub(channel),
        host_pb2_grpc.HostServiceStub(channel),
        ca=ca,
        admin_key=admin,
        runtime=runtime,
    )
    try:
        yield h
    finally:
        for host_id in list(h.agents):
            await h.stop_agent(host_id)
        await channel.close()
        await server.stop()


@contextlib.contextmanager
def threaded_harness(
    tmp: Path, images: ImageStore, prepare: Callable[[Harness], Awaitable[None]],
    runtime: RuntimeFactory = fake_runtime,
) -> Iterator[str]:  # fmt: skip
    """A harness on a thread (and event loop) of its own, for tests that call it
    synchronously: `prepare` runs first (start agents, register hosts); yields the address.
    `runtime` as `harness`'s."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        async def main() -> None:
            stop = asyncio.Event()
            box["stop"] = (asyncio.get_running_loop(), stop)
            async with harness(tmp, images, runtime=runtime) as h:
                await prepare(h)
                box["address"] = h.server.address
                ready.set()
                await stop.wait()

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(120), "the harness did not start"
    try:
        yield str(box["address"])
    finally:
        loop, stop = box["stop"]
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
