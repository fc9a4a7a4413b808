"""One gridworld episode whose actions come from the inference gateway (runs inside a machine).

Standard library only: the machine's python3 has no gRPC, so this calls the gateway's HTTP
endpoint (`FLEET_GATEWAY`, with the rollout's `FLEET_INFERENCE_TOKEN`). Each action's
idempotency key is the rollout and step number, so a retried call gets the same action back.
Prints one JSON line: seed, return, success, actions, and the devices that served them.
`program(seed)` returns the whole step (this module plus the environment) as one `python3 -c`.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

MODEL = "gridworld-policy"


def act(gateway: str, token: str, rollout: str, key: str, observation: list[float]) -> dict:  # type: ignore[type-arg]
    body = json.dumps({
        "token": token, "rollout_id": rollout, "idempotency_key": key, "model": MODEL,
        "input": observation,
    }).encode()  # fmt: skip
    for _ in range(50):  # a full queue or a failover answers with a hint: wait and retry
        request = urllib.request.Request(
            f"http://{gateway}/v1/infer", data=body,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return json.loads(reply.read())  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            if exc.code not in (429, 503):
                why = f"gateway refused step {key}: {exc.code} {exc.read()[:300]!r}"
                raise SystemExit(why) from None
            time.sleep(float(exc.headers.get("Retry-After", "0.1")))
    raise SystemExit(f"gateway kept refusing step {key}")


def checkpoint_get(relay: str) -> dict | None:  # type: ignore[type-arg]
    """The latest saved state of this rollout, or None (a first attempt)."""
    with urllib.request.urlopen(f"http://{relay}/checkpoint", timeout=30) as reply:
        return json.loads(reply.read()) if reply.status == 200 else None


def checkpoint_put(relay: str, seq: int, state: dict) -> None:  # type: ignore[type-arg]
    """Returns once the fleet has stored the state: only then is the next model call made."""
    request = urllib.request.Request(
        f"http://{relay}/checkpoint?seq={seq}", data=json.dumps(state).encode(), method="PUT"
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        reply.read()


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
    waited = []
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
            checkpoint_put(relay, step, {"actions": actions, "devices": sorted(devices)})
        delay = float(os.environ.get("FLEET_EPISODE_STEP_DELAY_S", "0"))
        if delay:
            time.sleep(delay)  # tests and demos: an episode slow enough to interrupt
    return {"seed": seed, "return": round(total, 4), "success": env.agent == env.goal,
            "actions": actions, "devices": sorted(devices), "resumed_at": resumed_at,
            "action_ms": round(1000 * sum(waited) / max(1, len(waited)), 3)}  # fmt: skip


def program(seed: int) -> list[str]:
    """The step's argv: python3 -c with the environment and this client inlined."""
    here = Path(__file__).parent
    parts = [(here / "gridworld.py").read_text(), Path(__file__).read_text()]
    future = "from __future__ import annotations\n"
    source = future + "".join(part.replace(future, "") for part in parts)
    source += f"\nprint(json.dumps(run_episode({int(seed)})), flush=True)\n"
    return ["python3", "-c", source]
