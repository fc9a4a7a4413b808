"""fleet: serve, run agents, submit and watch rollouts, run a Smolfile locally, demo."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc

from fleet._proto.fleet.v1 import fleet_pb2, fleet_pb2_grpc, types_pb2
from fleet.cli import client, logs
from fleet.cli.admin import add_commands as add_admin_commands
from fleet.cli.admin import duration_s
from fleet.config import Paths
from fleet.core.errors import FleetError, InvalidArgument
from fleet.identity.local import ensure_admin_key
from fleet.runtime.netns import NetConfig
from fleet.server.auth import Security

DEFAULT_SERVER = "127.0.0.1:50051"
STATE_NAMES = {v: k.removeprefix("ROLLOUT_STATE_") for k, v in types_pb2.RolloutState.items()}


def _server_default() -> str:
    return os.environ.get("FLEET_SERVER", DEFAULT_SERVER)


def _default_db(paths: Paths) -> Path:
    return paths.home / "ledger.sqlite3"


async def _until_signalled(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


# -- server side -------------------------------------------------------------------------------


async def cmd_serve(args: argparse.Namespace) -> int:
    from fleet.image.store import ImageStore
    from fleet.ledger.store import Ledger
    from fleet.server.app import FleetServer, ServerConfig

    paths = Paths.from_env()
    security = serve_security(args, paths)
    registry_ca = (
        await asyncio.to_thread(Path(args.registry_ca).read_bytes) if args.registry_ca else b""
    )
    ledger = Ledger.open(args.db or str(_default_db(paths)))
    server = FleetServer(
        ledger,
        ImageStore(paths.images, paths.recipes),
        args.listen,
        security=security,
        config=ServerConfig(
            lease_ttl_s=args.lease_ttl_s,
            heartbeat_interval_s=args.heartbeat_s,
            token_secret=Paths.from_env().token_secret(),
            gateway_address=args.gateway,
            backpressure_queue_depth=args.backpressure_depth,
            metrics_listen=args.metrics_listen,
            artifacts_dir=args.artifacts_dir,
            max_input_mib=args.max_input_mib,
            max_output_mib=args.max_output_mib,
            retain_days=args.retain_days,
            registry=args.registry,
            artifacts_registry=args.artifacts_registry,
            registry_ca=registry_ca,
        ),
    )
    await server.start()
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
    await _until_signalled(asyncio.Event())
    await server.stop()
    return 0


def serve_security(args: argparse.Namespace, paths: Paths) -> Security | None:
    """TLS and authentication with --tls, and always beyond loopback; none on loopback without
    --tls, or anywhere with --insecure (said loudly)."""
    from fleet.identity.ca import CertificateAuthority
    from fleet.identity.tls import is_loopback, split_address

    host, _ = split_address(args.listen)
    if args.insecure:
        if args.tls:
            raise SystemExit("fleet serve: --tls and --insecure contradict each other")
        return None
    if not args.tls and is_loopback(host):
        return None
    if not CertificateAuthority.exists(paths.ca):
        why = "--tls" if args.tls else f"listening on {args.listen}, beyond loopback,"
        raise SystemExit(
            f"fleet serve: {why} needs the fleet CA: run `fleet ca init` first "
            "(or --insecure to serve without TLS or authentication)"
        )
    return Security(
        CertificateAuthority.load(paths.ca), host_listen=args.host_listen, san=args.san,
        host_cert_ttl_s=duration_s(args.host_cert_ttl),
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
    from gateway.batcher import BatchConfig
    from gateway.http import serve_http
    from gateway.service import Gateway, GatewayConfig, serve

    paths = Paths.from_env()
    config = GatewayConfig(
        secret=paths.token_secret(), device=args.device, capacity_mib=args.capacity_mib,
        dtype=args.dtype, engine=args.engine, log_level=args.log_level or args.default_log_level,
        stream_outstanding=args.stream_outstanding, reserve_device_memory=not args.no_reserve,
        batch=BatchConfig(
            max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, max_queue=args.max_queue,
            max_inflight_per_rollout=args.max_inflight_per_rollout,
            answers_kept=args.answers_kept, answers_kept_mib=args.answers_kept_mib,
        ),
    )  # fmt: skip
    grpc_tls, http_tls, ca = gateway_tls(args, paths)
    gw = Gateway.build(config)
    server, port = await serve(gw, args.listen, grpc_tls)
    host, _, http_port = args.http_listen.rpartition(":")
    http, bound = await serve_http(gw, host, int(http_port), tls=http_tls)
    scheme = "https" if http_tls is not None else "http"
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
    await _until_signalled(asyncio.Event())
    http.close()
    await gw.batcher.stop()
    await server.stop(5)
    return 0


def gateway_tls(args: argparse.Namespace, paths: Paths) -> tuple[Any, Any, str]:
    """TLS for each of the gateway's endpoints that is not on loopback (unless --insecure),
    with a certificate from the fleet CA: (gRPC credentials, HTTP context, CA fingerprint)."""
    from fleet.identity.ca import CertificateAuthority
    from fleet.identity.tls import (
        ServerTls,
        is_loopback,
        server_names,
        server_ssl_context,
        split_address,
    )

    hosts = {name: split_address(address)[0] for name, address in
             (("--listen", args.listen), ("--http-listen", args.http_listen))}  # fmt: skip
    wide = [name for name, host in hosts.items() if not is_loopback(host)]
    if args.insecure or not wide:
        if args.insecure and wide:
            print(f"fleet gateway: {', '.join(wide)} beyond loopback WITHOUT TLS (--insecure)",
                  file=sys.stderr, flush=True)  # fmt: skip
        return None, None, ""
    if not CertificateAuthority.exists(paths.ca):
        raise SystemExit(
            f"fleet gateway: {', '.join(wide)} beyond loopback needs TLS from the fleet CA in "
            f"{paths.ca} (fleet ca init, on the server's host), or --insecure"
        )
    ca = CertificateAuthority.load(paths.ca)
    names = server_names(args.http_listen, [*args.san, hosts["--listen"]])
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
    from fleet.agent.agent import Agent, AgentConfig, default_host_id
    from fleet.agent.capabilities import capabilities, choose_runtime
    from fleet.agent.link import enroll
    from fleet.core.placement import HostClass
    from fleet.identity.tls import HostFiles
    from fleet.image.store import ImageStore

    paths = Paths.from_env()
    images = ImageStore(paths.images, paths.recipes)
    choice = choose_runtime(args.runtime, paths.home, images)
    host_class = HostClass(args.host_class)
    host_id = args.host_id or default_host_id(host_class)
    gateway = gateway_endpoint(args.gateway)
    files = HostFiles(Path(args.identity_dir) if args.identity_dir else paths.host_identity)
    identity = None
    if files.exists():
        identity = files.load()
        if not identity.valid():
            raise SystemExit(
                f"fleet agent: this host's certificate ({files.cert}) expired at "
                f"{identity.not_after:.0f}; enroll again with a new --join token after "
                f"removing {files.directory}"
            )
        if args.host_id and args.host_id != identity.host_id:
            raise SystemExit(
                f"fleet agent: {files.directory} holds host {identity.host_id!r}'s identity, "
                f"not {args.host_id!r}'s: drop --host-id, or use another --identity-dir"
            )
        host_id = identity.host_id
        if args.join:
            print(f"fleet agent: enrolled already as {host_id}; the join token was not used",
                  flush=True)  # fmt: skip
    registry_ca = (
        await asyncio.to_thread(Path(args.registry_ca).read_bytes) if args.registry_ca else b""
    )
    gateway_ca = b""
    if args.gateway.startswith("https://"):
        if args.ca:
            gateway_ca = await asyncio.to_thread(Path(args.ca).read_bytes)
        elif files.exists():
            gateway_ca = await asyncio.to_thread(files.ca.read_bytes)
        elif not args.join:
            raise SystemExit(
                "fleet agent: --gateway https://… needs the fleet CA to verify it: --ca FILE, "
                "or enroll (--join)"
            )
    if args.join and not files.exists():
        caps = capabilities(host_id, host_class, choice, args.slots).model_copy(
            update={"gateway": gateway is not None}
        )
        ca_pem = await asyncio.to_thread(Path(args.ca).read_bytes) if args.ca else b""
        identity = await enroll(args.server, args.join, host_id, caps, files,
                                ca_fingerprint=args.ca_fingerprint, ca_pem=ca_pem)  # fmt: skip
        print(f"fleet agent: enrolled as {host_id}; identity in {files.directory}", flush=True)
        gateway_ca = gateway_ca or (identity.ca_pem if args.gateway.startswith("https://") else b"")
    agent = Agent(
        AgentConfig(
            server=args.server,
            identity=identity,
            identity_files=files if identity is not None else None,
            host_id=host_id,
            host_class=host_class,
            runtime=choice,
            machines_dir=Path(args.machines_dir) if args.machines_dir else paths.machines,
            images=images,
            slots=args.slots,
            net=net_config(args.egress_uplink, args.egress_dns),
            gateway=gateway,
            gateway_ca=gateway_ca,
            image_cache_gib=args.image_cache_gib,
            registry_ca=registry_ca,
        )
    )
    print(f"fleet agent: {host_class}-class, runtime {choice.kind} ({choice.reason})", flush=True)
    stop = asyncio.Event()
    waiter = asyncio.create_task(_until_signalled(stop))
    await agent.run(stop)
    waiter.cancel()
    return 0


async def cmd_up(args: argparse.Namespace) -> int:
    from fleet.cli.embedded import embedded_fleet

    paths = Paths.from_env()
    db = Path(args.db) if args.db else _default_db(paths)
    async with embedded_fleet(paths, db, listen=args.listen, slots=args.slots) as fleet:
        print(
            f"fleet up: server on {fleet.address}, ledger {db}, 1 gpu-class + 2 cpu-class agents, "
            f"runtime {fleet.runtime.kind} ({fleet.runtime.reason})",
            flush=True,
        )
        await _until_signalled(asyncio.Event())
    return 0


# -- client side -------------------------------------------------------------------------------


def _stub(args: argparse.Namespace) -> tuple[grpc.aio.Channel, fleet_pb2_grpc.FleetServiceStub]:
    auth = client.ClientAuth.find(
        Paths.from_env().home, ca=args.ca, key=args.key, plaintext=args.plaintext
    )
    channel = auth.channel(args.server)
    return channel, fleet_pb2_grpc.FleetServiceStub(channel)


def _print_rollout(r: types_pb2.Rollout, as_json: bool) -> None:
    if as_json:
        print(json.dumps(client.rollout_dict(r), indent=2))
        return
    print(f"rollout   {r.id}")
    print(f"state     {STATE_NAMES[r.state]}")
    print(f"class     {types_pb2.HostClass.Name(r.host_class).removeprefix('HOST_CLASS_').lower()}")
    print(f"attempts  {r.attempts}")
    if r.host_id:
        runtime = types_pb2.RuntimeKind.Name(r.runtime).removeprefix("RUNTIME_KIND_").lower()
        print(f"served by {r.host_id} (runtime {runtime}, device {r.device})")
    if r.error:
        print(f"error     {r.error}")
    if r.HasField("egress"):
        mode = types_pb2.EgressPolicy.Mode.Name(r.egress.mode).removeprefix("MODE_").lower()
        allowed = ", ".join([*r.egress.allow_hosts, *r.egress.allow_cidrs])
        print(f"egress    {mode}{': ' + allowed if allowed else ''} ({r.egress.enforced_by})")
    for a in r.attempt_history:
        ended = f"{a.ended_at.ToDatetime():%H:%M:%S}" if a.HasField("ended_at") else "running"
        print(
            f"attempt {a.attempt} on {a.host_id}: {a.started_at.ToDatetime():%H:%M:%S} -> {ended} "
            f"{a.outcome} {a.error}".rstrip()
        )
    for o in r.outputs:
        what = "directory (tar)" if o.directory else "file"
        if o.digest:
            print(f"output    {o.path}: {what}, {o.size} bytes, {o.digest}")
        else:
            print(f"output    {o.path}: not stored: {o.error}")
    for s in r.results:
        flag = " (timed out)" if s.timed_out else ""
        print(f"-- step {s.index} {s.name}: exit {s.exit_code}{flag}, {s.duration_s:.3f}s")
        if s.stdout:
            print(s.stdout.decode(errors="replace").rstrip())
        if s.stderr:
            print("[stderr] " + s.stderr.decode(errors="replace").rstrip())


async def cmd_submit(args: argparse.Namespace) -> int:
    from fleet.core.smolfile import load_smolfile

    steps = client.load_plan(args.plan) if args.plan else client.steps_from_flags(args.step)
    if load_smolfile(args.smolfile).spec.dev is not None:
        print(
            f"fleet submit: {args.smolfile}'s [dev] section is for local runs (fleet run) and "
            "is ignored here; send data with --input SRC:/path",
            file=sys.stderr,
        )
    sources = [client.parse_input(spec) for spec in args.input]
    channel, stub = _stub(args)
    inputs = []
    image_upload = ""
    async with channel:
        for src, dest, directory in sources:
            inputs.append(await client.upload(stub, src, dest, directory))
        image_upload = await client.upload_image_archive(stub, args.smolfile)
    request = client.submit_request(
        args.smolfile,
        steps,
        key=args.idempotency_key,
        labels=client.parse_labels(args.label),
        deadline_s=args.deadline_s,
        max_attempts=args.max_attempts,
        require_vm=args.require_vm,
        require_cuda_device=args.require_cuda_device,
        inference=args.inference,
        tenant=args.tenant,
        inputs=inputs,
        outputs=args.output,
    )
    request.image_upload = image_upload
    channel, stub = _stub(args)
    async with channel:
        reply = await stub.SubmitRollout(request, timeout=30)
        print(
            reply.rollout.id
            if args.quiet
            else f"{reply.rollout.id} "
            + ("submitted" if reply.created else "already submitted (same key)")
        )
        if args.wait:
            await _watch(stub, reply.rollout.id, 0)
            final = await stub.GetRollout(fleet_pb2.GetRolloutRequest(id=reply.rollout.id))
            _print_rollout(final, False)
            return 0 if final.state == types_pb2.ROLLOUT_STATE_SUCCEEDED else 1
    return 0


async def _watch(stub: fleet_pb2_grpc.FleetServiceStub, rollout_id: str, after: int) -> None:
    # Reconnects after a dropped stream and resumes after the last sequence seen.
    for _ in range(100):
        try:
            call = stub.WatchRollout(
                fleet_pb2.WatchRolloutRequest(id=rollout_id, after_sequence=after)
            )
            async for e in call:
                after = e.sequence
                move = ""
                if e.to_state:
                    before = STATE_NAMES[e.from_state] if e.from_state else "-"
                    move = f"{before} -> {STATE_NAMES[e.to_state]}"
                print(
                    f"#{e.sequence:<6} {e.at.ToDatetime():%H:%M:%S} {e.kind:<18} {move:<22} "
                    f"{e.actor} {e.message}".rstrip(),
                    flush=True,
                )
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            await asyncio.sleep(1.0)


async def cmd_watch(args: argparse.Namespace) -> int:
    channel, stub = _stub(args)
    async with channel:
        await _watch(stub, args.id, args.after)
    return 0


async def cmd_get(args: argparse.Namespace) -> int:
    channel, stub = _stub(args)
    async with channel:
        rollout = await stub.GetRollout(fleet_pb2.GetRolloutRequest(id=args.id))
        _print_rollout(rollout, args.json)
        if args.download:
            written = await client.download(stub, rollout, Path(args.download))
            print(f"downloaded {len(written)} outputs to {args.download}", file=sys.stderr)
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    channel, stub = _stub(args)
    async with channel:
        reply = await stub.ListRollouts(
            fleet_pb2.ListRolloutsRequest(
                page_size=args.page_size,
                page_token=args.page_token,
                labels=client.parse_labels(args.label),
                could_reach=args.could_reach,
            )
        )
    for r in reply.rollouts:
        labels = ",".join(f"{k}={v}" for k, v in sorted(r.labels.items()))
        print(f"{r.id}  {STATE_NAMES[r.state]:<10} attempts={r.attempts} {labels}")
    if reply.next_page_token:
        print(f"next page: --page-token {reply.next_page_token}")
    return 0


async def cmd_cancel(args: argparse.Namespace) -> int:
    import uuid

    channel, stub = _stub(args)
    async with channel:
        r = await stub.CancelRollout(
            fleet_pb2.CancelRolloutRequest(
                request_id=uuid.uuid4().hex, id=args.id, reason=args.reason
            )
        )
    print(
        f"{r.id} {STATE_NAMES[r.state]}"
        + (" (stop requested)" if r.state == types_pb2.ROLLOUT_STATE_RUNNING else "")
    )
    return 0


async def cmd_top(args: argparse.Namespace) -> int:
    from fleet.cli.top import run_top

    return await run_top(args.metrics, args.gateway_metrics, args.interval_s, args.once)


async def cmd_egress_events(args: argparse.Namespace) -> int:
    """What a rollout's machines were refused: DNS queries and connections, oldest first."""
    import json
    from datetime import UTC, datetime

    channel, stub = _stub(args)
    async with channel:
        reply = await stub.ListEgressEvents(
            fleet_pb2.ListEgressEventsRequest(rollout_id=args.rollout_id)
        )
    if args.json:
        for e in reply.events:
            print(json.dumps({
                "rollout_id": e.rollout_id, "attempt": e.attempt, "machine": e.machine,
                "at": e.at.ToDatetime(tzinfo=UTC).isoformat(), "kind": e.kind,
                "destination": e.destination, "decision": e.decision, "reason": e.reason,
            }))  # fmt: skip
        return 0
    if not reply.events:
        print(f"{args.rollout_id}: no refused DNS queries or connections")
        return 0
    print(f"{'time (UTC)':<24} {'try':>3}  {'kind':<7}  {'destination':<40}  reason")
    for e in reply.events:
        at = e.at.ToDatetime(tzinfo=UTC)
        when = datetime.strftime(at, "%Y-%m-%d %H:%M:%S.%f")[:23]
        print(f"{when:<24} {e.attempt:>3}  {e.kind:<7}  {e.destination:<40}  {e.reason}")
    return 0


# -- local -------------------------------------------------------------------------------------


def dev_volumes(
    smolfile: str, volumes: list[str]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """[dev] volumes `SOURCE:TARGET[:ro]` (SOURCE relative to the Smolfile) -> (read-only,
    writable) pairs of (host path, path in the machine); a missing SOURCE is refused."""
    base = Path(smolfile).resolve().parent
    read_only: list[tuple[str, str]] = []
    writable: list[tuple[str, str]] = []
    for volume in volumes:
        source, target, *mode = volume.split(":")
        host = (base / source).resolve()
        if not host.exists():
            raise SystemExit(f"fleet run: [dev] volume {volume!r}: {host} does not exist")
        (read_only if mode == ["ro"] else writable).append((str(host), target))
    return read_only, writable


async def cmd_run(args: argparse.Namespace) -> int:
    """One machine from a Smolfile, the command's output streamed to this terminal."""
    from fleet.agent.capabilities import choose_runtime, make_runtime
    from fleet.core.manifest import image_of
    from fleet.core.smolfile import load_smolfile
    from fleet.image.oci import looks_like_archive
    from fleet.image.store import ImageStore
    from fleet.runtime.base import MachineSpec, resolve_secrets

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    parsed = load_smolfile(args.smolfile)
    if not command:
        command = [*parsed.spec.entrypoint, *parsed.spec.cmd]
    if not command:
        print(
            "fleet run: no command given and the Smolfile has no entrypoint or cmd", file=sys.stderr
        )
        return 2
    paths = Paths.from_env()
    images = ImageStore(paths.images, paths.recipes)
    choice = choose_runtime(args.runtime, paths.home, images)
    print(f"fleet run: runtime {choice.kind} ({choice.reason})", file=sys.stderr, flush=True)
    dev = parsed.spec.dev
    read_only: list[tuple[str, str]] = []
    writable: list[tuple[str, str]] = []
    if dev is not None:
        # [dev] is for this path: applied here, refused where it cannot be, never dropped.
        unsupported = [k for k, v in (("user", dev.user), ("ports", dev.ports)) if v]
        if dev.volumes and choice.kind != "namespace":
            unsupported.append("volumes")
        if unsupported:
            what = ", ".join(unsupported)
            print(f"fleet run: {args.smolfile}: [dev] {what} is not supported by the "
                  f"{choice.kind} runtime; remove it to run here", file=sys.stderr)  # fmt: skip
            return 2
        read_only, writable = await asyncio.to_thread(dev_volumes, args.smolfile, dev.volumes)
    image = image_of(parsed)
    if looks_like_archive(image):
        archive = client.archive_path(args.smolfile, image)
        digest = (await asyncio.to_thread(images.import_archive, archive)).digest
    else:
        digest = images.resolve(image)
    runtime = make_runtime(choice, paths.machines)
    spec = MachineSpec(
        name="fleet-run-" + os.urandom(4).hex(),
        smolfile=parsed.spec,
        image_digest=digest,
        rootfs=await asyncio.to_thread(images.rootfs, digest),
        labels={"fleet": "run"},
        secrets=resolve_secrets(parsed.spec),
        read_only=tuple(read_only),
        writable=tuple(writable),
    )
    machine = await runtime.create(spec)
    dev_env = dict(item.split("=", 1) for item in dev.env) if dev is not None else {}
    workdir = dev.workdir if dev is not None else None
    inits = [*parsed.spec.init, *(dev.init if dev is not None else [])]

    def show(stream: str, chunk: bytes) -> None:
        out = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
        out.write(chunk)
        out.flush()

    try:
        for init in inits:
            res = await machine.exec(
                ["/bin/sh", "-c", init], env=dev_env, timeout_s=args.timeout_s, on_output=show
            )
            if res.exit_code != 0:
                print(f"fleet run: init {init!r} exited {res.exit_code}", file=sys.stderr)
                return res.exit_code
        result = await machine.exec(command, env=dev_env, workdir=workdir,
                                    timeout_s=args.timeout_s, on_output=show)  # fmt: skip
    finally:
        await machine.delete()
    if result.timed_out:
        print(f"fleet run: timed out after {args.timeout_s:g}s", file=sys.stderr)
        return 124
    return result.exit_code


async def cmd_image(args: argparse.Namespace) -> int:
    from fleet.image.store import ImageStore

    paths = Paths.from_env()
    store = ImageStore(paths.images, paths.recipes)
    if args.image_cmd == "build":
        record, built = await asyncio.to_thread(store.build, args.name, force=args.force)
        if not args.quiet or built:
            print(
                f"{record.name} {record.digest} {'built' if built else 'cached'}", file=sys.stderr
            )
    elif args.image_cmd == "list":
        for r in store.list_images():
            print(f"{r.name:<16} {r.digest}  {r.size_bytes / 1e6:8.1f} MB")
    elif args.image_cmd == "inspect":
        found = store.record(args.name)
        if found is None:
            print(f"fleet image: no image {args.name!r}", file=sys.stderr)
            return 1
        print(found.model_dump_json(indent=2))
    elif args.image_cmd == "rm":
        # A running namespace machine has the unpacked tree as its read-only lower layer.
        busy = any(paths.machines.glob("*/*"))
        for path in store.remove(args.name, keep_tree=busy):
            print(f"removed {path}")
        if busy:
            print(f"kept the unpacked tree: machines exist under {paths.machines}")
    elif args.image_cmd == "pack":
        return await pack_image(store, paths, args.name, args.out)
    elif args.image_cmd in ("push", "pull"):
        return await asyncio.to_thread(push_or_pull, store, args)
    return 0


def push_or_pull(store: Any, args: argparse.Namespace) -> int:
    """`fleet image push NAME|DIGEST --registry URL/REPO` / `fleet image pull REF`."""
    from fleet.image import oci

    ca = Path(args.ca).read_bytes() if args.ca else None
    credentials = oci.Credentials.from_env()
    if args.image_cmd == "push":
        digest = store.resolve(args.name)
        blob = store.verify(digest)
        repo = oci.Reference.parse(args.registry)
        tag = args.tag or (args.name if not args.name.startswith("sha256:") else digest[7:19])
        with oci.Registry(repo, credentials, ca) as registry:
            manifest = oci.push(registry, blob, digest, tag)
        print(f"pushed {args.name} ({digest}) as {repo.with_tag(tag)} (manifest {manifest})")
        return 0
    ref = oci.Reference.parse(args.ref)
    with oci.Registry(ref, credentials, ca) as registry:
        layer, digest = oci.layer_of(registry, ref.digest or ref.tag or "latest")
        if not store.blob_path(digest).exists():
            oci.pull_layer(registry, layer, digest, store.blob_path(digest))
    store.mark_verified(digest)
    name = args.name or (ref.tag if ref.tag else ref.repository.rsplit("/", 1)[-1])
    record = store.add_pulled(name, digest, str(ref))
    print(f"pulled {ref} as {record.name} ({digest}, {record.size_bytes / 1e6:.1f} MB)")
    return 0


async def pack_image(store: Any, paths: Paths, name: str, out: str) -> int:
    """`fleet image pack`: a .smolmachine of the image, where microVMs boot."""
    from fleet.agent.capabilities import canary_image
    from fleet.core.smolfile import parse_smolfile
    from fleet.runtime import smol as smol_runtime
    from fleet.runtime.base import MachineSpec

    record = store.record(name)
    if record is None:
        print(f"fleet image pack: no image {name!r} (fleet image build {name})", file=sys.stderr)
        return 1
    ok, why = await asyncio.to_thread(
        smol_runtime.preflight, paths.home, lambda: canary_image(store)
    )
    if not ok:
        print(f"fleet image pack: microVMs cannot boot here: {why}", file=sys.stderr)
        return 1
    rootfs = await asyncio.to_thread(store.rootfs, record.digest)
    spec = MachineSpec(
        name=f"fleet-pack-{name}", smolfile=parse_smolfile(f'image = "{name}"\n').spec,
        image_digest=record.digest, rootfs=rootfs, labels={"fleet": "1", "pack": name},
    )  # fmt: skip
    target = Path.cwd() / (out or f"{name}-{record.digest[7:19]}.smolmachine")
    path = await smol_runtime.SmolRuntime().pack(spec, target)
    print(f"{name} {record.digest} packed: {path}")
    return 0


async def cmd_policy(args: argparse.Namespace) -> int:
    from fleet.core import policy

    def read(path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as exc:
            raise InvalidArgument(f"{path}: cannot read: {exc}") from exc

    if args.policy_cmd == "explain":
        print("\n".join(policy.explain(read(args.file), args.file)))
        return 0
    if args.policy_cmd == "diff":
        print("\n".join(policy.diff(read(args.old), args.old, read(args.new), args.new)))
        return 0
    org = policy.load_org_policy(args.org_policy) if args.org_policy else None
    findings = [f for path in args.paths for f in policy.audit_text(read(path), path, org)]
    threshold = policy.Severity[args.fail_on.upper()]
    if args.format == "json":
        print(
            json.dumps(
                [f.model_dump(mode="json") | {"severity": str(f.severity)} for f in findings],
                indent=2,
            )
        )
    elif args.format == "sarif":
        print(json.dumps(policy_sarif(findings), indent=2))
    else:
        for f in findings:
            where = f"{f.file}:{f.line}" if f.line else f.file
            print(f"{where}: {f.severity} {f.rule} {f.message}")
        print(
            f"{len(findings)} findings in {len(args.paths)} files "
            f"({len(policy.at_or_above(findings, threshold))} at or above {args.fail_on})"
        )
    return 1 if policy.at_or_above(findings, threshold) else 0


def policy_sarif(findings: list[Any]) -> dict[str, Any]:
    """SARIF 2.1.0, so code-scanning tools show the findings on the lines they name."""
    from fleet.core.policy import RULES

    level = {1: "note", 2: "warning", 3: "error"}
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "fleet policy audit",
                        "rules": [
                            {
                                "id": r.id,
                                "shortDescription": {"text": r.summary},
                                "defaultConfiguration": {"level": level[int(r.severity)]},
                            }
                            for r in RULES.values()
                        ],
                    }
                },
                "results": [
                    {
                        "ruleId": f.rule,
                        "level": level[int(f.severity)],
                        "message": {"text": f.message},
                        "locations": [
                            {
                                "physicalLocation": {
                                    "artifactLocation": {"uri": f.file},
                                    "region": {"startLine": f.line or 1},
                                }
                            }
                        ],
                    }
                    for f in findings
                ],
            }
        ],
    }


async def cmd_demo(args: argparse.Namespace) -> int:
    from fleet.cli.demo import run_demo

    return await run_demo(
        Paths.from_env(),
        timeout_s=args.timeout_s,
        out_dir=Path(args.out),
        episodes=args.episodes,
        log_level=args.log_level or args.default_log_level,
    )


# -- parser ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleet", description=__doc__)
    p.add_argument(
        "--log-level", default=None, help="debug, info, warning (default depends on command)"
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(
        name: str,
        fn: Callable[[argparse.Namespace], Coroutine[Any, Any, int]],
        help_: str,
        log_level: str = "warning",
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(fn=fn, default_log_level=log_level)
        return sp

    def server_flag(sp: argparse.ArgumentParser, *, client_auth: bool = True) -> None:
        sp.add_argument(
            "--server",
            default=_server_default(),
            help=f"fleet server host:port (default $FLEET_SERVER or {DEFAULT_SERVER})",
        )
        if not client_auth:
            return
        sp.add_argument(
            "--key", default="",
            help="API key (default $FLEET_KEY, else $FLEET_HOME/admin.key when it exists)",
        )  # fmt: skip
        sp.add_argument(
            "--ca", default="",
            help="the fleet CA's certificate, to verify the server with (default $FLEET_CA, "
            "else $FLEET_HOME/ca/ca.crt when it exists; without one, no TLS)",
        )  # fmt: skip
        sp.add_argument(
            "--plaintext", action="store_true",
            help="no TLS (a server started with --insecure or without a CA)",
        )  # fmt: skip

    sp = add("serve", cmd_serve, "run a fleet server", "info")
    sp.add_argument("--listen", default=DEFAULT_SERVER)
    sp.add_argument(
        "--db",
        help="a SQLite file or a postgresql:// URL (default $FLEET_HOME/ledger.sqlite3); "
        "several servers may share one PostgreSQL database",
    )
    sp.add_argument("--lease-ttl-s", type=float, default=15.0, help="lease life without a beat")
    sp.add_argument("--heartbeat-s", type=float, default=3.0, help="agents' heartbeat interval")
    sp.add_argument(
        "--gateway", default="",
        help="the inference gateway's gRPC address, watched for backpressure",
    )  # fmt: skip
    sp.add_argument(
        "--metrics-listen", default="",
        help="host:port where GET /metrics answers in Prometheus text (e.g. 127.0.0.1:9464)",
    )  # fmt: skip
    sp.add_argument(
        "--backpressure-depth", type=int, default=256,
        help="gateway queue depth at which rollouts that use it stop being started",
    )  # fmt: skip
    sp.add_argument("--artifacts-dir", default="",
                    help="where inputs and outputs are kept (default: beside a SQLite ledger, "
                    "else $FLEET_HOME/artifacts)")  # fmt: skip
    sp.add_argument("--max-input-mib", type=float, default=1024.0,
                    help="a rollout's inputs together, at most (default 1024)")  # fmt: skip
    sp.add_argument("--max-output-mib", type=float, default=1024.0,
                    help="a rollout's outputs together, at most (default 1024)")  # fmt: skip
    sp.add_argument("--registry", default="",
                    help="[https://]HOST[:PORT]/REPO: hosts fetch images they lack from this OCI "
                    "registry, by digest (credentials: their $FLEET_REGISTRY_AUTH); default: "
                    "from this server")  # fmt: skip
    sp.add_argument("--artifacts-registry", default="",
                    help="[https://]HOST[:PORT]/REPO: keep inputs and outputs in this OCI "
                    "registry (replicas sharing a PostgreSQL ledger share it)")  # fmt: skip
    sp.add_argument("--registry-ca", default="",
                    help="a CA registries' certificates chain to (besides the system's and the "
                    "fleet's)")  # fmt: skip
    sp.add_argument("--retain-days", type=float, default=30.0,
                    help="finished rollouts are deleted with their inputs and outputs this many "
                    "days after they end (default 30; 0 keeps them)")  # fmt: skip
    sp.add_argument("--tls", action="store_true",
                    help="TLS and authentication on a loopback address too (always on "
                    "beyond loopback unless --insecure)")  # fmt: skip
    sp.add_argument("--insecure", action="store_true",
                    help="no TLS and no authentication, even beyond loopback: any caller may "
                    "act as any tenant or host")  # fmt: skip
    sp.add_argument("--host-listen", default="",
                    help="host:port of the mutual-TLS endpoint hosts call (default: the "
                    "--listen host, port 50054)")  # fmt: skip
    sp.add_argument("--san", action="append", default=[],
                    help="another name or address the server's certificate carries "
                    "(repeatable; the listen addresses are always in it)")  # fmt: skip
    sp.add_argument(
        "--host-cert-ttl", default="24h",
        help="life of the certificates hosts get (default 24h; renewed at 2/3)",
    )  # fmt: skip

    sp = add("agent", cmd_agent, "run a host agent", "info")
    server_flag(sp, client_auth=False)
    sp.add_argument("--join", default="", metavar="TOKEN",
                    help="enroll with this join token (fleet host token create) unless this "
                    "host holds a valid certificate already")  # fmt: skip
    sp.add_argument("--ca-fingerprint", default="",
                    help="sha256:… of the fleet CA, to pin it when enrolling "
                    "(printed by fleet host token create)")  # fmt: skip
    sp.add_argument("--ca", default="", help="the fleet CA's certificate, instead of a fingerprint")
    sp.add_argument(
        "--identity-dir", default="",
        help="where this host keeps its key and certificate (default $FLEET_HOME/host)",
    )  # fmt: skip
    sp.add_argument("--class", dest="host_class", choices=["gpu", "cpu"], required=True)
    sp.add_argument("--runtime", choices=["auto", "smol", "namespace"], default="auto")
    sp.add_argument("--slots", type=int, default=2, help="work items run at once")
    sp.add_argument("--registry-ca", default="",
                    help="a CA the image registry's certificate chains to (besides the system's "
                    "and the fleet's)")  # fmt: skip
    sp.add_argument(
        "--image-cache-gib", type=float, default=20.0,
        help="images fetched from the server kept here, at most (least recently used removed "
        "first, never one in use; default 20)",
    )  # fmt: skip
    sp.add_argument("--host-id", default="")
    sp.add_argument("--machines-dir", default="", help="default $FLEET_HOME/machines")
    sp.add_argument(
        "--egress-uplink", default="",
        help="network namespace where machine links end (default: this host, with forwarding "
        "and masquerade in fleet's own nftables table)",
    )  # fmt: skip
    sp.add_argument(
        "--egress-dns", default="",
        help="resolver the machines' DNS forwarder asks, ADDRESS[:PORT] "
        "(default: first nameserver in /etc/resolv.conf)",
    )  # fmt: skip

    sp.add_argument(
        "--gateway", default="",
        help="the inference gateway's HTTP endpoint as machines reach it: ADDRESS:PORT, or "
        "host:PORT for a gateway on this host (rollouts that use inference need it); "
        "https://… when it serves TLS (verified against the fleet CA)",
    )  # fmt: skip

    sp = add("gateway", cmd_gateway, "run the inference gateway (GPU host)", "info")
    sp.add_argument("--listen", default="127.0.0.1:50052", help="gRPC address")
    sp.add_argument(
        "--http-listen", default="0.0.0.0:50053",
        help="HTTP address machines call (they reach only it, and only with a rollout token)",
    )  # fmt: skip
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    sp.add_argument(
        "--insecure", action="store_true",
        help="no TLS on endpoints beyond loopback (by default they use a certificate from the "
        "fleet CA in $FLEET_HOME/ca)",
    )  # fmt: skip
    sp.add_argument("--san", action="append", default=[],
                    help="another name its certificate carries (repeatable)")  # fmt: skip
    sp.add_argument(
        "--dtype", default="", choices=["", "float32", "bfloat16"],
        help="the primary's precision (default: the model manifest's, float32 if it names none)",
    )  # fmt: skip
    sp.add_argument(
        "--capacity-mib", type=float, default=0.0,
        help="primary memory budget (default: the device's, or RAM/4 on CPU)",
    )  # fmt: skip
    sp.add_argument(
        "--engine", default="process", choices=["process", "inline"],
        help="where the primary's model runs: a process of its own, started again after a "
        "device error or a hang (default), or a thread of the gateway's process",
    )  # fmt: skip
    sp.add_argument(
        "--no-reserve", action="store_true",
        help="on CUDA, do not take at load the memory batches up to --max-batch need (then "
        "another process filling the GPU sends batches to the CPU replica)",
    )  # fmt: skip
    sp.add_argument("--max-batch", type=int, default=64)
    sp.add_argument("--max-wait-ms", type=float, default=2.0)
    sp.add_argument("--max-queue", type=int, default=2048)
    sp.add_argument("--max-inflight-per-rollout", type=int, default=16)
    sp.add_argument(
        "--answers-kept", type=int, default=200_000,
        help="answers remembered for idempotent retries (oldest forgotten first)",
    )  # fmt: skip
    sp.add_argument(
        "--answers-kept-mib", type=float, default=256.0,
        help="memory those answers may take (estimated); past it the oldest are forgotten too",
    )  # fmt: skip
    sp.add_argument(
        "--stream-outstanding", type=int, default=256,
        help="requests one InferStream may have outstanding before the gateway stops reading it",
    )  # fmt: skip

    sp = add("up", cmd_up, "server + 1 gpu-class + 2 cpu-class agents, SQLite, one process", "info")
    sp.add_argument("--listen", default=DEFAULT_SERVER)
    sp.add_argument("--db")
    sp.add_argument("--slots", type=int, default=2)

    sp = add("submit", cmd_submit, "submit a rollout")
    server_flag(sp)
    sp.add_argument("-s", "--smolfile", required=True)
    group = sp.add_mutually_exclusive_group()
    group.add_argument("--step", action="append", default=[], help="a step command (repeatable)")
    group.add_argument("--plan", help="TOML plan file with [[steps]]")
    sp.add_argument("--idempotency-key", default=None,
                    help="idempotency key (default: a new one)")  # fmt: skip
    sp.add_argument("--label", action="append", default=[], help="KEY=VALUE (repeatable)")
    sp.add_argument("--deadline-s", type=float, default=None)
    sp.add_argument("--max-attempts", type=int, default=0)
    sp.add_argument("--require-vm", action="store_true", help="never run on namespace isolation")
    sp.add_argument("--require-cuda-device", action="store_true")
    sp.add_argument(
        "--inference", action="store_true",
        help="its steps call the inference gateway: the machine may reach it, and gets "
        "FLEET_GATEWAY and a token for this rollout in FLEET_INFERENCE_TOKEN",
    )  # fmt: skip
    sp.add_argument("--tenant", default="")
    sp.add_argument(
        "--input", action="append", default=[], metavar="SRC:/PATH",
        help="a file or directory uploaded and placed read-only at PATH in the machine before "
        "the first step (repeatable)",
    )  # fmt: skip
    sp.add_argument(
        "--output", action="append", default=[], metavar="/PATH",
        help="a file or directory in the machine collected after the last step (repeatable; "
        "fleet get --download writes them out)",
    )  # fmt: skip
    sp.add_argument("--wait", action="store_true", help="watch until it ends, then print it")
    sp.add_argument("-q", "--quiet", action="store_true", help="print only the rollout id")

    sp = add("watch", cmd_watch, "stream a rollout's events")
    server_flag(sp)
    sp.add_argument("id")
    sp.add_argument("--after", type=int, default=0, help="resume after this sequence number")

    sp = add("get", cmd_get, "show a rollout")
    server_flag(sp)
    sp.add_argument("id")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--download", default="", metavar="DIR",
                    help="write the rollout's outputs into DIR")  # fmt: skip

    sp = add("list", cmd_list, "list rollouts, newest first")
    server_flag(sp)
    sp.add_argument("--label", action="append", default=[])
    sp.add_argument("--page-size", type=int, default=50)
    sp.add_argument("--page-token", default="")
    sp.add_argument(
        "--could-reach",
        default="",
        metavar="HOST",
        help="only rollouts whose machine's effective egress allowed HOST (for review)",
    )

    sp = add("cancel", cmd_cancel, "cancel a rollout")
    server_flag(sp)
    sp.add_argument("id")
    sp.add_argument("--reason", default="")

    sp = add("top", cmd_top, "live metrics of a server and its gateway")
    sp.add_argument("--metrics", default="http://127.0.0.1:9464/metrics",
                    help="the server's metrics URL (fleet serve --metrics-listen)")  # fmt: skip
    sp.add_argument("--gateway-metrics", default="http://127.0.0.1:50053/metrics",
                    help="the gateway's metrics URL (its HTTP endpoint)")  # fmt: skip
    sp.add_argument("--interval-s", type=float, default=1.0)
    sp.add_argument("--once", action="store_true", help="print once and exit")

    sp = add("egress-events", cmd_egress_events, "list what a rollout's machines were refused")
    server_flag(sp)
    sp.add_argument("rollout_id")
    sp.add_argument("--json", action="store_true", help="one JSON object per line")

    sp = add("run", cmd_run, "run one command in one machine from a Smolfile, locally")
    sp.add_argument("-s", "--smolfile", required=True)
    sp.add_argument("--runtime", choices=["auto", "smol", "namespace"], default="auto")
    sp.add_argument("--timeout-s", type=float, default=3600.0)
    sp.add_argument("command", nargs=argparse.REMAINDER)

    sp = add("image", cmd_image, "build and list images", "info")
    isub = sp.add_subparsers(dest="image_cmd", required=True)
    b = isub.add_parser("build", help="build an image from images/NAME/recipe.toml (cached)")
    b.add_argument("name")
    b.add_argument("--force", action="store_true")
    b.add_argument("--quiet", action="store_true", help="say nothing when it was cached")
    isub.add_parser("list", help="list stored images")
    i = isub.add_parser("inspect", help="digest, size, recipe, created time")
    i.add_argument("name")
    r = isub.add_parser("rm", help="remove an image (its archive too if nothing else names it)")
    r.add_argument("name")
    u = isub.add_parser("push", help="push an image to an OCI registry ($FLEET_REGISTRY_AUTH)")
    u.add_argument("name", help="a stored image's name or sha256:… digest")
    u.add_argument("--registry", required=True, help="[https://]HOST[:PORT]/REPO")
    u.add_argument("--tag", default="", help="default: the image's name")
    u.add_argument("--ca", default="", help="a CA to trust besides the system's (fleet's own)")
    u = isub.add_parser("pull", help="pull an image from an OCI registry ($FLEET_REGISTRY_AUTH)")
    u.add_argument("ref", help="[https://]HOST[:PORT]/REPO[:TAG|@sha256:…]")
    u.add_argument("--name", default="", help="store name (default: the tag)")
    u.add_argument("--ca", default="", help="a CA to trust besides the system's (fleet's own)")
    k = isub.add_parser("pack", help="pack an image into a .smolmachine (microVM hosts)")
    k.add_argument("name")
    k.add_argument("--out", default="", help="default: NAME-DIGEST.smolmachine here")

    sp = add("policy", cmd_policy, "audit, explain and diff Smolfiles' egress policy")
    psub = sp.add_subparsers(dest="policy_cmd", required=True)
    a = psub.add_parser("audit", help="findings with file, line, rule, severity")
    a.add_argument("paths", nargs="+")
    a.add_argument("--org-policy", help="the organisation's policy (TOML)")
    a.add_argument("--format", choices=["text", "json", "sarif"], default="text")
    a.add_argument(
        "--fail-on",
        choices=["low", "medium", "high"],
        default="high",
        help="exit 1 when a finding is at or above this severity (default high)",
    )
    e = psub.add_parser("explain", help="the effective egress policy in plain words")
    e.add_argument("file")
    d = psub.add_parser("diff", help="the egress a change adds and removes")
    d.add_argument("old")
    d.add_argument("new")

    add_admin_commands(add)

    sp = add("demo", cmd_demo, "evaluate the shipped suite on an embedded fleet", "error")
    sp.add_argument("--timeout-s", type=float, default=600.0)
    sp.add_argument("--out", default="fleet-demo-out", help="where the chart is written")
    sp.add_argument("--episodes", type=int, default=64, help="gridworld episodes to evaluate")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level or args.default_log_level)
    try:
        code: int = asyncio.run(args.fn(args))
        return code
    except FleetError as exc:
        print(f"fleet {args.cmd}: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        print(f"fleet {args.cmd}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        if exc.code() == grpc.StatusCode.UNAVAILABLE and "ssl" in (exc.details() or "").lower():
            print(
                "  (TLS failed: a server started without TLS, on loopback without --tls, needs "
                "--plaintext; one with TLS needs the fleet CA: --ca FILE or $FLEET_CA)",
                file=sys.stderr,
            )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
