"""A real Harbor run against fleet: Harbor's oracle agent solves a task of our own
(`tests/data/harbor-task`) in a fleet session, and Harbor's verifier scores it there.

Harbor needs Python 3.12 or newer; `scripts/setup-harbor` (run by `scripts/test`) builds one
from Debian's source package and a venv with Harbor. Harbor runs as its own process, with
this checkout on its path for `fleet.providers.harbor`, against a server and agent of ours.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.core.placement import HostClass
from fleet.image.store import ImageStore
from tests.integration.harness import Harness, threaded_harness

REPO = Path(__file__).resolve().parents[2]
TASK = REPO / "tests" / "data" / "harbor-task"


@pytest.fixture(scope="module")
def harbor_venv() -> Path:
    done = subprocess.run(
        [str(REPO / "scripts" / "setup-harbor")], capture_output=True, text=True, timeout=3000
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def harbor_fleet(tmp_path_factory: pytest.TempPathFactory, images: ImageStore) -> Iterator[str]:
    async def prepare(h: Harness) -> None:
        await h.start_agent("cpu-a", HostClass.CPU, slots=4)

    with threaded_harness(tmp_path_factory.mktemp("harbor"), images, prepare) as address:
        yield address


def test_harbors_oracle_solves_a_task_in_a_fleet_session(
    harbor_venv: Path, harbor_fleet: str, tmp_path: Path
) -> None:
    from fleet.client import Fleet

    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "FLEET_SERVER": harbor_fleet,
        "FLEET_KEY": "",
        "FLEET_HOME": str(tmp_path / "home"),  # (no CA there: plain gRPC to the test server)
        "HOME": str(tmp_path / "home"),
        "NO_COLOR": "1",
        # Nothing leaves the machine: no telemetry, and LiteLLM's bundled price table instead
        # of the one it would fetch.
        "HARBOR_TELEMETRY": "0",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    run = subprocess.run(
        [str(harbor_venv / "bin" / "harbor"), "run", "-p", str(TASK), "-a", "oracle",
         "-e", "fleet.providers.harbor:FleetEnvironment", "-o", str(tmp_path / "jobs"), "-y"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert "githubusercontent" not in run.stdout + run.stderr  # (it tried to reach out)
    results = sorted((tmp_path / "jobs").rglob("result.json"))
    trial = [json.loads(p.read_text()) for p in results if (p.parent / "verifier").is_dir()]
    assert len(trial) == 1, [str(p) for p in results]
    rewards = trial[0]["verifier_result"]["rewards"]
    assert rewards == {"reward": 1.0}, trial[0]
    machine = next((tmp_path / "jobs").rglob("verifier/machine.txt")).read_text().strip()
    with Fleet(harbor_fleet, plaintext=True) as fleet:
        sessions = [r for r in fleet.list(labels={"fleet.session": "1"})
                    if r.labels.get("harbor.task")]  # fmt: skip
    # The agent's commands and the verifier's ran in fleet sessions, all closed at the end;
    # the file the solution wrote names the machine of one of them.
    assert sessions and all(r.state == "SUCCEEDED" for r in sessions)
    assert any(machine == f"fleet-{r.id}-a1" for r in sessions), (machine, sessions)
