"""The evaluation suite `fleet demo` runs: 24 rollouts shipped with the project.

Sixteen CPU rollouts step a small gridworld environment with a scripted policy and score the
episode in a second step (the score step reads the file the first one wrote, in the same
machine). Six gpu-class rollouts run the policy's batched inference in the warm-parent Smolfile
(`cuda = true`): on a host without a CUDA device they run on the CPU and the result says so.
One rollout carries a deliberately wrong expected score and fails its check, and one's step
exceeds its timeout: failures are part of what a fleet must report honestly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENV_STEP = r"""
import json, os, random
seed = int(os.environ["EPISODE_SEED"])
rng = random.Random(seed)
size, pos, goal, reward, trace = 8, [0, 0], [7, 7], 0.0, []
for t in range(64):
    # scripted policy: move towards the goal, with 20% exploration
    if rng.random() < 0.2:
        move = rng.choice([(1, 0), (0, 1), (-1, 0), (0, -1)])
    else:
        move = (1, 0) if pos[0] < goal[0] and (pos[1] >= goal[1] or rng.random() < 0.5) else (0, 1)
    pos = [min(size - 1, max(0, pos[0] + move[0])), min(size - 1, max(0, pos[1] + move[1]))]
    reward -= 0.01
    trace.append(pos[:])
    if pos == goal:
        reward += 1.0
        break
json.dump({"seed": seed, "steps": len(trace), "reward": round(reward, 4), "trace": trace},
          open("/root/episode.json", "w"))
print(f"episode seed={seed} steps={len(trace)} reward={reward:.3f}")
"""

SCORE_STEP = r"""
import json, os, sys
ep = json.load(open("/root/episode.json"))
minimum = float(os.environ.get("MIN_REWARD", "0"))
ok = ep["reward"] >= minimum
print(json.dumps({"seed": ep["seed"], "reward": ep["reward"], "pass": ok}))
sys.exit(0 if ok else 1)
"""

POLICY_STEP = r"""
import json, math, os, random
seed = int(os.environ["BATCH_SEED"])
rng = random.Random(seed)
# a tiny two-layer policy network, evaluated for a batch of 256 observations
w1 = [[rng.gauss(0, 0.3) for _ in range(16)] for _ in range(8)]
w2 = [[rng.gauss(0, 0.3) for _ in range(4)] for _ in range(16)]
actions = []
for _ in range(256):
    obs = [rng.random() for _ in range(8)]
    h = [max(0.0, sum(obs[i] * w1[i][j] for i in range(8))) for j in range(16)]
    logits = [sum(h[j] * w2[j][k] for j in range(16)) for k in range(4)]
    z = max(logits)
    p = [math.exp(v - z) for v in logits]
    actions.append(max(range(4), key=lambda k: p[k]))
print(json.dumps({"batch": 256, "device": os.environ.get("FLEET_DEVICE", "?"),
                  "action_histogram": [actions.count(k) for k in range(4)]}))
"""


@dataclass(frozen=True)
class DemoRollout:
    name: str
    smolfile: str
    steps: list[tuple[str, list[str], dict[str, str], float]] = field(default_factory=list)


def suite() -> list[DemoRollout]:
    out: list[DemoRollout] = []
    for seed in range(16):
        out.append(
            DemoRollout(
                name=f"gridworld-{seed:02d}",
                smolfile="eval-worker.smolfile",
                steps=[
                    ("episode", ["python3", "-c", ENV_STEP], {"EPISODE_SEED": str(seed)}, 60.0),
                    ("score", ["python3", "-c", SCORE_STEP], {"MIN_REWARD": "-1"}, 60.0),
                ],
            )
        )
    for seed in range(6):
        out.append(
            DemoRollout(
                name=f"policy-batch-{seed}",
                smolfile="gpu-parent.smolfile",
                steps=[("policy", ["python3", "-c", POLICY_STEP], {"BATCH_SEED": str(seed)}, 60.0)],
            )
        )
    out.append(
        DemoRollout(
            name="gridworld-strict-check",
            smolfile="eval-worker.smolfile",
            steps=[
                ("episode", ["python3", "-c", ENV_STEP], {"EPISODE_SEED": "99"}, 60.0),
                ("score", ["python3", "-c", SCORE_STEP], {"MIN_REWARD": "5"}, 60.0),
            ],
        )
    )
    out.append(
        DemoRollout(
            name="stuck-tool-call",
            smolfile="minimal.smolfile",
            steps=[("hang", ["sleep", "30"], {}, 1.0)],
        )
    )
    return out
