"""One gridworld episode whose actions come from the inference gateway (runs inside a machine).

Standard library only: the machine's python3 has no gRPC, so this calls the gateway's HTTP
endpoint (`FLEET_GATEWAY`, with the rollout's `FLEET_INFERENCE_TOKEN`). Each action's
idempotency key is the rollout and step number, so a retried call gets the same action back.
Prints one JSON line: seed, return, success, actions, and the devices that served them.
`program(seed)` returns the whole step (this module plus the environment) as one `python3 -c`.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from pathlib import Path

MODEL = "gridworld-policy"
"""The model asked for, unless the step's environment names another (`FLEET_MODEL`)."""


_CONNECTIONS: dict = {}  # type: ignore[type-arg]


def call(where: str, method: str, path: str, body: bytes | None = None, timeout: float = 30):  # type: ignore[no-untyped-def]
    """(status, headers, body) of one request, on a connection kept open per endpoint.

    Every request here may be sent twice (inference requests carry an idempotency key, a
    checkpoint its sequence number), so one broken keep-alive connection is retried once on a
    new one.
    """
    for attempt in (1, 2):
        conn = _CONNECTIONS.get(where)
        if conn is None:
            conn = _CONNECTIONS[where] = http.client.HTTPConnection(where, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            data = reply.read()
        except (http.client.HTTPException, OSError):
            conn.close()
            del _CONNECTIONS[where]
            if attempt == 2:
                raise
            continue
        if reply.will_close:
            conn.close()
            del _CONNECTIONS[where]
        return reply.status, reply.headers, data
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
        time.sleep(float(headers.get("Retry-After", "0.1")))
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


def program(seed: int) -> list[str]:
    """The step's argv: python3 -c with the environment and this client inlined."""
    here = Path(__file__).parent
    parts = [(here / "gridworld.py").read_text(), Path(__file__).read_text()]
    future = "from __future__ import annotations\n"
    source = future + "".join(part.replace(future, "") for part in parts)
    source += f"\nprint(json.dumps(run_episode({int(seed)})), flush=True)\n"
    return ["python3", "-c", source]
