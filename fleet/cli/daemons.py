"""`fleet serve`, `fleet agent`, `fleet gateway`, `fleet up`: the long-running processes."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fleet import heap
from fleet.agent.settings import AgentSettings
from fleet.cli.admin import duration_s
from fleet.cli.client import parse_labels
from fleet.config import Paths
from fleet.console.settings import ConsoleSettings
from fleet.core.cost import parse_prices
from fleet.core.errors import InvalidArgument
from fleet.identity.local import ensure_admin_key
from fleet.runtime.netns import NetConfig
from fleet.server.auth import Security
from fleet.server.settings import ServeSettings
from fleet.settings import SettingsError
from gateway.settings import GatewaySettings

S = TypeVar("S")


def settings_of(read: Callable[[], S]) -> S:
    """A daemon's settings from its flags and environment; a bad value is fleet's own
    InvalidArgument (the message names the flag or variable it came from)."""
    try:
        return read()
    except SettingsError as exc:
        raise InvalidArgument(str(exc)) from None


def default_db(paths: Paths) -> Path:
    return paths.home / "ledger.sqlite3"


def _on_signals(stop: asyncio.Event) -> asyncio.Event:
    """`stop`, set from now on by SIGINT or SIGTERM (installed before a daemon says it is ready,
    so a signal sent as soon as it says so stops it cleanly instead of killing it)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _until_signalled(stop: asyncio.Event) -> None:
    await _on_signals(stop).wait()


async def cmd_serve(args: argparse.Namespace) -> int:
    from fleet.image.store import ImageStore
    from fleet.ledger.store import Ledger
    from fleet.server.app import FleetServer

    settings = settings_of(lambda: ServeSettings.from_args(args))
    console = settings_of(lambda: ConsoleSettings.from_args(args))
    paths = Paths.from_env()
    security = serve_security(settings, paths)
    registry_ca = (
        await asyncio.to_thread(Path(settings.registry_ca_file).read_bytes)
        if settings.registry_ca_file
        else b""
    )
    ledger = Ledger.open(settings.db or str(default_db(paths)))
    if settings.price:  # (kept in the ledger: fleet report reads them there)
        ledger.set_prices(parse_prices(settings.price), time.time())
    server = FleetServer(
        ledger,
        ImageStore(paths.images, paths.recipes),
        settings.listen,
        security=security,
        config=settings.server_config(paths.token_secret(), registry_ca),
        console_listen=console.console_listen,
    )
    await server.start()
    heap.settle()
    stop = _on_signals(asyncio.Event())
    if server.console_port:
        host = console.console_listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
        scheme = "https" if security is not None else "http"
        print(f"fleet console at {scheme}://{host}:{server.console_port}/", flush=True)
    if security is None:
        print(
            f"fleet server listening on {server.address} WITHOUT TLS OR AUTHENTICATION: any "
            "caller that reaches it may act as any tenant or host",
            flush=True,
        )
    else:
        wrote = await asyncio.to_thread(ensure_admin_key, paths, ledger)
        print(
            f"fleet server listening on {server.address} (TLS, API keys); hosts call "
            f"{server.host_address} (mutual TLS); CA {security.ca.fingerprint}"
            + (f"; an admin key for this user is in {paths.admin_key}" if wrote else ""),
            flush=True,
        )
    await stop.wait()
    await server.stop()
    return 0


def serve_security(settings: ServeSettings, paths: Paths) -> Security | None:
    """TLS and authentication with --tls, and always beyond loopback; none on loopback without
    --tls, or anywhere with --insecure (said loudly)."""
    from fleet.identity.ca import CertificateAuthority
    from fleet.identity.tls import is_loopback, split_address

    host, _ = split_address(settings.listen)
    if settings.insecure:
        if settings.tls:
            raise SystemExit("fleet serve: --tls and --insecure contradict each other")
        return None
    if not settings.tls and is_loopback(host):
        return None
    if not CertificateAuthority.exists(paths.ca):
        why = "--tls" if settings.tls else f"listening on {settings.listen}, beyond loopback,"
        raise SystemExit(
            f"fleet serve: {why} needs the fleet CA: run `fleet ca init` first "
            "(or --insecure to serve without TLS or authentication)"
        )
    return Security(
        CertificateAuthority.load(paths.ca), host_listen=settings.host_listen, san=settings.san,
        host_cert_ttl_s=duration_s(settings.host_cert_ttl),
    )  # fmt: skip


def net_config(uplink: str, dns: str) -> NetConfig:
    """The agent's egress settings from its flags; a malformed resolver address is refused."""
    import ipaddress

    from fleet.runtime.netns import default_upstream

    upstream = default_upstream()
    if dns:
        host, _, port = dns.partition(":")
        try:
            upstream = (str(ipaddress.IPv4Address(host)), int(port or 53))
        except ValueError:
            raise SystemExit(f"--egress-dns {dns!r}: expected an IPv4 ADDRESS[:PORT]") from None
    if uplink and not Path(f"/run/netns/{uplink}").exists():
        raise SystemExit(f"--egress-uplink {uplink!r}: no network namespace /run/netns/{uplink}")
    return NetConfig(uplink_netns=uplink or None, dns_upstream=upstream)


async def cmd_gateway(args: argparse.Namespace) -> int:
    """The inference gateway: gRPC InferenceService plus the HTTP endpoint machines call."""
    from gateway import require_torch

    require_torch()
    from gateway.http import serve_http
    from gateway.llm.upstream import Upstreams
    from gateway.llm.upstream_config import load_upstreams
    from gateway.service import Gateway, serve

    # The global --log-level (None unless given) shares its name with the engine's setting:
    # the engine logs at the level the gateway itself runs at.
    log_level = args.log_level or args.default_log_level
    settings = settings_of(lambda: GatewaySettings.from_args(args, log_level=log_level))
    paths = Paths.from_env()
    config = settings.gateway_config(paths.token_secret(), log_level)
    grpc_tls, http_tls, ca = gateway_tls(settings, paths)
    # Upstreams and their keys are read and checked before any model loads: a bad flag or an
    # unreadable key fails the start, naming the flag, the variable or the file.
    upstreams = load_upstreams(settings.upstream, settings.upstream_key, settings.fallback,
                               settings.upstreams)  # fmt: skip
    gw = Gateway.build(config)
    if upstreams.upstreams:
        gw.upstreams = Upstreams(upstreams)
    server, port = await serve(gw, settings.listen, grpc_tls)
    host, _, http_port = settings.http_listen.rpartition(":")
    http, bound = await serve_http(
        gw, host, int(http_port), tls=http_tls, allow=http_allow(settings.http_allow)
    )
    scheme = "https" if http_tls is not None else "http"
    heap.settle()
    stop = _on_signals(asyncio.Event())
    print(
        f"fleet gateway: {gw.spec.name} {gw.spec.revision} on {gw.batcher.primary.device} "
        f"in {gw.spec.dtype} (CPU replica in float32 behind a breaker); gRPC on port {port}"
        f"{' (TLS)' if grpc_tls is not None else ''}, HTTP on port {bound} ({scheme}"
        + (f", CA {ca}" if ca else "")
        + "; agents: --gateway "
        + ("https://" if http_tls is not None else "")
        + f"ADDRESS:{bound})",
        flush=True,
    )
    if upstreams.upstreams:
        print(f"fleet gateway: upstreams {', '.join(sorted(upstreams.upstreams))} (models as "
              f"NAME/MODEL; fallback chains: {len(upstreams.fallbacks)})", flush=True)  # fmt: skip
    await stop.wait()
    http.close()
    await gw.stop()
    if gw.upstreams is not None:
        await gw.upstreams.aclose()
    await server.stop(5)
    return 0


def http_allow(text: str) -> Any:
    """--http-allow: the default peers (loopback, the machines' pool) and these CIDRs; 'any':
    everyone (None)."""
    import ipaddress

    from gateway.http import DEFAULT_ALLOW

    if text.strip() == "any":
        return None
    extra = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            extra.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise SystemExit(f"--http-allow {item!r}: not a CIDR range") from None
    return (*DEFAULT_ALLOW, *extra)


def gateway_tls(settings: GatewaySettings, paths: Paths) -> tuple[Any, Any, str]:
    """TLS for each of the gateway's endpoints that is not on loopback (unless --insecure),
    with a certificate from the fleet CA: (gRPC credentials, HTTP context, CA fingerprint)."""
    from fleet.core.hostnames import GATEWAY_NAME
    from fleet.identity.ca import CertificateAuthority
    from fleet.identity.tls import (
        ServerTls,
        is_loopback,
        server_names,
        server_ssl_context,
        split_address,
    )

    hosts = {name: split_address(address)[0] for name, address in
             (("--listen", settings.listen), ("--http-listen", settings.http_listen))}  # fmt: skip
    wide = [name for name, host in hosts.items() if not is_loopback(host)]
    if settings.insecure or not wide:
        if settings.insecure and wide:
            print(f"fleet gateway: {', '.join(wide)} beyond loopback WITHOUT TLS (--insecure)",
                  file=sys.stderr, flush=True)  # fmt: skip
        return None, None, ""
    if not CertificateAuthority.exists(paths.ca):
        raise SystemExit(
            f"fleet gateway: {', '.join(wide)} beyond loopback needs TLS from the fleet CA in "
            f"{paths.ca} (fleet ca init, on the server's host), or --insecure"
        )
    ca = CertificateAuthority.load(paths.ca)
    names = server_names(settings.http_listen, [*settings.san, hosts["--listen"], GATEWAY_NAME])
    tls = ServerTls.issue(ca, names)
    grpc_tls = tls.credentials(require_client_cert=False) if "--listen" in wide else None
    http_tls = server_ssl_context(tls) if "--http-listen" in wide else None
    return grpc_tls, http_tls, ca.fingerprint


def gateway_endpoint(text: str) -> tuple[str, int] | None:
    """--gateway ADDRESS:PORT ("host" for this host as machines see it); empty: none."""
    import ipaddress

    if not text:
        return None
    host, _, port = text.removeprefix("https://").rpartition(":")
    try:
        if host != "host":
            host = str(ipaddress.IPv4Address(host))
        return host, int(port)
    except ValueError:
        raise SystemExit(f"--gateway {text!r}: expected ADDRESS:PORT or host:PORT") from None


async def cmd_agent(args: argparse.Namespace) -> int:
    from fleet.agent.agent import Agent, default_host_id
    from fleet.agent.capabilities import capabilities, choose_runtime
    from fleet.agent.config import AgentConfig
    from fleet.agent.link import enroll
    from fleet.core.placement import HostClass
    from fleet.identity.tls import HostFiles
    from fleet.image.store import ImageStore

    settings = settings_of(lambda: AgentSettings.from_args(args))
    paths = Paths.from_env()
    images = ImageStore(paths.images, paths.recipes)
    choice = choose_runtime(settings.runtime, paths.home, images)
    host_class = HostClass(settings.host_class)
    host_id = settings.host_id or default_host_id(host_class)
    gateway = gateway_endpoint(settings.gateway)
    files = HostFiles(Path(settings.identity_dir) if settings.identity_dir else paths.host_identity)
    identity = None
    if files.exists():
        identity = files.load()
        if not identity.valid():
            raise SystemExit(
                f"fleet agent: this host's certificate ({files.cert}) expired at "
                f"{identity.not_after:.0f}; enroll again with a new --join token after "
                f"removing {files.directory}"
            )
        if settings.host_id and settings.host_id != identity.host_id:
            raise SystemExit(
                f"fleet agent: {files.directory} holds host {identity.host_id!r}'s identity, "
                f"not {settings.host_id!r}'s: drop --host-id, or use another --identity-dir"
            )
        host_id = identity.host_id
        if settings.join:
            print(f"fleet agent: enrolled already as {host_id}; the join token was not used",
                  flush=True)  # fmt: skip
    registry_ca = (
        await asyncio.to_thread(Path(settings.registry_ca_file).read_bytes)
        if settings.registry_ca_file
        else b""
    )
    gateway_ca = b""
    if settings.gateway.startswith("https://"):
        if settings.ca:
            gateway_ca = await asyncio.to_thread(Path(settings.ca).read_bytes)
        elif files.exists():
            gateway_ca = await asyncio.to_thread(files.ca.read_bytes)
        elif not settings.join:
            raise SystemExit(
                "fleet agent: --gateway https://… needs the fleet CA to verify it: --ca FILE, "
                "or enroll (--join)"
            )
    if settings.join and not files.exists():
        caps = capabilities(host_id, host_class, choice, settings.slots).model_copy(
            update={"gateway": gateway is not None}
        )
        ca_pem = await asyncio.to_thread(Path(settings.ca).read_bytes) if settings.ca else b""
        identity = await enroll(settings.server, settings.join, host_id, caps, files,
                                ca_fingerprint=settings.ca_fingerprint, ca_pem=ca_pem)  # fmt: skip
        print(f"fleet agent: enrolled as {host_id}; identity in {files.directory}", flush=True)
        gateway_ca = gateway_ca or (
            identity.ca_pem if settings.gateway.startswith("https://") else b""
        )
    agent = Agent(
        AgentConfig(
            server=settings.server,
            identity=identity,
            identity_files=files if identity is not None else None,
            host_id=host_id,
            host_class=host_class,
            runtime=choice,
            machines_dir=Path(settings.machines_dir) if settings.machines_dir else paths.machines,
            images=images,
            slots=settings.slots,
            net=net_config(settings.egress_uplink, settings.egress_dns),
            gateway=gateway,
            gateway_ca=gateway_ca,
            image_cache_gib=settings.image_cache_gib,
            default_disk_gib=settings.default_disk_gib or None,
            registry_ca=registry_ca,
            drain_deadline_s=duration_s(settings.drain_deadline),
            labels=parse_labels(settings.label),
        )
    )
    print(f"fleet agent: {host_class}-class, runtime {choice.kind} ({choice.reason})", flush=True)
    stop = asyncio.Event()
    waiter = asyncio.create_task(_until_signalled(stop))
    await agent.run(stop)
    waiter.cancel()
    return 0


async def cmd_up(args: argparse.Namespace) -> int:
    from fleet.embedded import GatewayHandle, embedded_fleet, start_gateway

    paths = Paths.from_env()
    db = Path(args.db) if args.db else default_db(paths)
    handle: GatewayHandle | None = None
    if args.gateway:
        from gateway import require_torch
        from gateway.llm.upstream_config import load_upstreams

        require_torch()
        # Upstreams and their keys are checked before anything starts (as `fleet gateway`).
        upstreams = load_upstreams(args.upstream, args.upstream_key, args.fallback,
                                   Path(args.upstreams) if args.upstreams else None)  # fmt: skip
        handle = await start_gateway(paths, args.log_level or args.default_log_level, upstreams)
    elif args.upstream or args.upstream_key or args.fallback or args.upstreams:
        raise SystemExit("fleet up: --upstream, --upstream-key, --upstreams and --fallback "
                         "configure the gateway: add --gateway")  # fmt: skip
    try:
        async with embedded_fleet(
            paths, db, listen=args.listen, slots=args.slots,
            config=handle.server_config() if handle else None,
            gateway=("host", handle.http_port) if handle else None, gateway_tls=bool(handle),
        ) as fleet:  # fmt: skip
            heap.settle()
            stop = _on_signals(asyncio.Event())
            print(
                f"fleet up: server on {fleet.address}, ledger {db}, 1 gpu-class + 2 cpu-class "
                f"agents, runtime {fleet.runtime.kind} ({fleet.runtime.reason})",
                flush=True,
            )
            if handle is not None:
                gw = handle.gateway
                llm = gw.llm.model_id if gw.llm is not None else "none"
                ups = sorted(gw.upstreams.config.upstreams) if gw.upstreams is not None else []
                print(
                    f"fleet up: gateway on 127.0.0.1:{handle.grpc_port} (gRPC) and port "
                    f"{handle.http_port} (HTTPS, for machines); policy {gw.spec.name}, "
                    f"language model {llm} on {gw.batcher.primary.device}"
                    + (f", upstreams {', '.join(ups)}" if ups else "")
                    + "; rollouts submitted with --inference reach it",
                    flush=True,
                )
            await stop.wait()
    finally:
        if handle is not None:
            await handle.stop()
    return 0
