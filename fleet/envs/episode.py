"""One gridworld episode whose actions come from the inference gateway (runs inside a machine).

Standard library only: the machine's python3 has no gRPC, so this calls the gateway's HTTP
endpoint (`FLEET_GATEWAY`, with the rollout's `FLEET_INFERENCE_TOKEN`). Each action's
idempotency key is the rollout and step number, so a retried call gets the same action back.
Prints one JSON line: seed, return, success, actions, and the devices that served them.
`program(seed)` returns the whole step (this module plus the environment) as one `python3 -c`.

The HTTP client is a small one over a socket, for fleet's own endpoints (HTTP/1.1 keep-alive,
Content-Length bodies): importing `http.client` alone costs a machine's python ~30 ms of CPU,
and each request through it ~130 us more than here, paid once per episode and twice per action.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

MODEL = "gridworld-policy"
"""The model asked for, unless the step's environment names another (`FLEET_MODEL`)."""


_CONNECTIONS: dict = {}  # type: ignore[type-arg]
MAX_LINE = 65536


class ProtocolError(ConnectionError):
    """An answer that is not HTTP/1.1 with a Content-Length body."""


def _read_reply(stream) -> tuple[int, dict, bytes]:  # type: ignore[no-untyped-def,type-arg]
    line = stream.readline(MAX_LINE + 1)
    if not line:
        raise ConnectionError("the connection was closed before an answer")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"not an HTTP status line: {line[:80]!r}")
    headers = {}
    while True:
        line = stream.readline(MAX_LINE + 1)
        if line in (b"\r\n", b"\n"):
            break
        if not line or len(line) > MAX_LINE:
            raise ProtocolError("the answer's headers were cut off or too long")
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", ""):
        raise ProtocolError("chunked answers are not supported (fleet's endpoints never send them)")
    try:
        length = int(headers.get("content-length", "0") or 0)
    except ValueError:
        raise ProtocolError(f"bad Content-Length {headers['content-length']!r}") from None
    data = stream.read(length) if length else b""
    if len(data) != length:
        raise ConnectionError(f"the connection closed {len(data)} of {length} body bytes in")
    return int(parts[1]), headers, data


def _connect(where: str, timeout: float) -> socket.socket:
    """`host:port`, `https://host:port`, or `unix:PATH` (how a warm parent's child reaches the
    agent's sockets)."""
    if where.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(where.removeprefix("unix:"))
        except OSError:
            sock.close()
            raise
        return sock
    tls = where.startswith("https://")
    host, _, port = where.removeprefix("https://").rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls:  # the gateway beyond loopback: its certificate must chain to the fleet's CA
        try:
            sock = _tls_context().wrap_socket(sock, server_hostname=host.strip("[]"))
        except OSError:
            sock.close()
            raise
    return sock


_TLS: list = []  # type: ignore[type-arg]


def _tls_context() -> Any:
    """Verifies the chain to the fleet CA (`FLEET_GATEWAY_CA`) and the server purpose, not the
    name: a machine reaches the gateway at an address its certificate cannot list."""
    if not _TLS:
        import ssl

        context = ssl.create_default_context(cadata=os.environ["FLEET_GATEWAY_CA"])
        context.check_hostname = False
        _TLS.append(context)
    return _TLS[0]


def call(where: str, method: str, path: str, body: bytes | None = None, timeout: float = 30):  # type: ignore[no-untyped-def]
    """(status, lower-cased headers, body) of one request, on a connection kept per endpoint.

    Every request here may be sent twice (inference requests carry an idempotency key, a
    checkpoint its sequence number), so one broken keep-alive connection is retried once on a
    new one.
    """
    data = body or b""
    host = "localhost" if where.startswith("unix:") else where.removeprefix("https://")
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode("latin-1") + data
    for attempt in (1, 2):
        conn = _CONNECTIONS.get(where)
        try:
            if conn is None:
                sock = _connect(where, timeout)
                conn = _CONNECTIONS[where] = (sock, sock.makefile("rb"))
            conn[0].settimeout(timeout)
            conn[0].sendall(request)
            status, headers, payload = _read_reply(conn[1])
        except OSError:
            if conn is not None:
                conn[1].close()
                conn[0].close()
            _CONNECTIONS.pop(where, None)
            if attempt == 2:
                raise
            continue
        if headers.get("connection", "").lower() == "close":
            conn[1].close()
            conn[0].close()
            del _CONNECTIONS[where]
        return status, headers, payload
    raise AssertionError("unreachable")


def act(gateway: str, token: str, rollout: str, key: str, observation: list[float]) -> dict:  # type: ignore[type-arg]
    body = json.dumps({
        "token": token, "rollout_id": rollout, "idempotency_key": key,
        "model": os.environ.get("FLEET_MODEL", MODEL),
        "input": observation,
    }).encode()  # fmt: skip
    for _ in range(50):  # a full queue or a failover answers with a hint: wait and retry
        status, headers, data = call(gateway, "POST", "/v1/infer", body)
        if status == 200:
            return json.loads(data)  # type: ignore[no-any-return]
        if status not in (429, 503):
            raise SystemExit(f"gateway refused step {key}: {status} {data[:300]!r}")
        time.sleep(float(headers.get("retry-after", "0.1")))
    raise SystemExit(f"gateway kept refusing step {key}")


def checkpoint_get(relay: str) -> dict | None:  # type: ignore[type-arg]
    """The latest saved state of this rollout, or None (a first attempt)."""
    status, _, data = call(relay, "GET", "/checkpoint")
    if status not in (200, 204):
        raise SystemExit(f"checkpoint relay answered {status}: {data[:300]!r}")
    return json.loads(data) if status == 200 else None


def checkpoint_put(relay: str, seq: int, state: dict) -> None:  # type: ignore[type-arg]
    """Returns once the fleet has stored the state: only then is the next model call made."""
    status, _, data = call(relay, "PUT", f"/checkpoint?seq={seq}", json.dumps(state).encode(), 60)
    if status != 200 and status != 204:
        raise SystemExit(f"checkpoint {seq} was not stored: {status} {data[:300]!r}")


def run_episode(seed: int) -> dict:  # type: ignore[type-arg]
    from_globals = globals()
    env = from_globals["GridWorld"](seed)
    gateway, token = os.environ["FLEET_GATEWAY"], os.environ["FLEET_INFERENCE_TOKEN"]
    rollout = os.environ["FLEET_ROLLOUT_ID"]
    relay = os.environ.get("FLEET_CHECKPOINTS", "")
    total, actions, devices, done, step = 0.0, [], set(), False, 0
    saved = checkpoint_get(relay) if relay else None
    resumed_at = 0
    if saved:  # a later attempt: replay the stored actions (the environment is deterministic)
        for action in saved["actions"]:
            reward, done = env.step(action)
            total += reward
            actions.append(action)
        devices.update(saved["devices"])
        step = resumed_at = len(actions)
    waited, stored = [], []
    while not done:
        asked = time.monotonic()
        answer = act(gateway, token, rollout, f"{rollout}/step-{step}", env.observation())
        waited.append(time.monotonic() - asked)
        action = from_globals["argmax"](answer["output"])
        reward, done = env.step(action)
        total += reward
        actions.append(action)
        devices.add(answer["device"])
        step += 1
        if relay:
            asked = time.monotonic()
            checkpoint_put(relay, step, {"actions": actions, "devices": sorted(devices)})
            stored.append(time.monotonic() - asked)
        delay = float(os.environ.get("FLEET_EPISODE_STEP_DELAY_S", "0"))
        if delay:
            time.sleep(delay)  # tests and demos: an episode slow enough to interrupt
    return {"seed": seed, "return": round(total, 4), "success": env.agent == env.goal,
            "actions": actions, "devices": sorted(devices), "resumed_at": resumed_at,
            "action_ms": round(1000 * sum(waited) / max(1, len(waited)), 3),
            "checkpoint_ms": round(1000 * sum(stored) / max(1, len(stored)), 3)}  # fmt: skip


def source() -> str:
    """The environment and this client as one module's source (what a warm-up loads)."""
    here = Path(__file__).parent
    parts = [(here / "gridworld.py").read_text(), Path(__file__).read_text()]
    future = "from __future__ import annotations\n"
    return future + "".join(part.replace(future, "") for part in parts)


def program(seed: int) -> list[str]:
    """The step's argv: python3 -c with the environment and this client inlined."""
    code = source() + f"\nprint(json.dumps(run_episode({int(seed)})), flush=True)\n"
    return ["python3", "-c", code]


def warm_step(seed: int) -> list[str]:
    """The step's argv in a warm parent's child whose warm-up step was `source()`."""
    return ["python3", "-c", f"print(json.dumps(run_episode({int(seed)})), flush=True)"]
