"""Whole processes: `fleet up` in the background, `fleet submit` and `fleet get` against it."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.acceptance.procs import FLEET, free_port
from tests.conftest import REPO, SMOLFILES


@pytest.fixture
def fleet_up(tmp_path: Path):  # type: ignore[no-untyped-def]
    port = free_port()
    argv = [*FLEET, "up", "--listen", f"127.0.0.1:{port}", "--db", str(tmp_path / "ledger.sqlite3")]
    log = tmp_path / "fleet-up.log"  # (a pipe nobody reads could fill and stall it)
    with (
        log.open("w") as err,
        subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True) as proc,
    ):
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "fleet up:" not in line:
            proc.kill()
            pytest.fail(f"fleet up did not start: {line}{log.read_text()}")
        yield f"127.0.0.1:{port}", line
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-2000:]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FLEET, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "FLEET_SERVER": ""},
    )


@pytest.mark.sandbox
def test_up_submit_get(fleet_up: tuple[str, str]) -> None:
    """A rollout submitted with `fleet submit` to `fleet up` runs; `fleet get` shows its output."""
    server, banner = fleet_up
    assert "runtime" in banner
    submitted = cli(
        "submit",
        "--server",
        server,
        "-s",
        str(SMOLFILES / "minimal.smolfile"),
        "--step",
        "python3 -c 'print(6*7)'",
        "--label",
        "case=acceptance",
        "-q",
    )
    assert submitted.returncode == 0, submitted.stderr
    rollout_id = submitted.stdout.strip()
    assert rollout_id.startswith("r-")
    state = ""
    data: dict[str, object] = {}
    for _ in range(300):
        got = cli("get", "--server", server, rollout_id, "--json")
        assert got.returncode == 0, got.stderr
        data = json.loads(got.stdout)
        state = str(data["state"])
        if state in ("ROLLOUT_STATE_SUCCEEDED", "ROLLOUT_STATE_FAILED"):
            break
        time.sleep(0.1)
    assert state == "ROLLOUT_STATE_SUCCEEDED", data
    results = data["results"]
    assert isinstance(results, list)
    assert base64.b64decode(results[0]["stdout"]) == b"42\n"
    human = cli("get", "--server", server, rollout_id)
    assert "SUCCEEDED" in human.stdout and "42" in human.stdout
    listed = cli("list", "--server", server, "--label", "case=acceptance")
    assert rollout_id in listed.stdout
    watched = cli("watch", "--server", server, rollout_id)
    assert "submitted" in watched.stdout and "succeeded" in watched.stdout


def test_submit_with_a_bad_smolfile_fails_locally_with_file_and_line(tmp_path: Path) -> None:
    """`fleet submit` refuses a malformed Smolfile before sending, naming file, line and key."""
    bad = tmp_path / "bad.smolfile"
    bad.write_text('image = "minimal"\ncpus = "two"\n')
    out = cli("submit", "--server", "127.0.0.1:1", "-s", str(bad), "--step", "true")
    assert out.returncode == 2
    assert f"{bad}:2: key 'cpus'" in out.stderr


def test_submit_says_a_dev_section_is_ignored(tmp_path: Path) -> None:
    """A Smolfile's [dev] section is for local runs: `fleet submit` says so in one line."""
    dev = tmp_path / "dev.smolfile"
    dev.write_text('image = "minimal"\n[dev]\nvolumes = ["./src:/src"]\n')
    out = cli("submit", "--server", "127.0.0.1:1", "--plaintext", "-s", str(dev), "--step", "true")
    assert "[dev] section is for local runs" in out.stderr and "--input" in out.stderr


@pytest.mark.sandbox
def test_fleet_run_applies_the_dev_section(tmp_path: Path) -> None:
    """`fleet run` mounts [dev] volumes (read-only where marked), sets its env and workdir,
    and runs its init, as its user; a key it cannot honour is refused, not dropped."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "code.txt").write_text("source\n")
    (tmp_path / "out").mkdir()
    smolfile = tmp_path / "dev.smolfile"
    smolfile.write_text(
        'image = "minimal"\n[dev]\nvolumes = ["./src:/src:ro", "./out:/out"]\n'
        'env = ["MODE=dev"]\nworkdir = "/src"\ninit = ["echo init ran > /out/init.txt"]\n'
    )
    script = (
        'cat code.txt; echo "$MODE"; echo made > /out/made.txt; '
        "if touch /src/x 2>/dev/null; then echo WRITABLE; else echo read-only; fi"
    )
    out = cli("run", "-s", str(smolfile), "--", "sh", "-c", script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["source", "dev", "read-only"]
    assert (tmp_path / "out" / "made.txt").read_text() == "made\n"
    assert (tmp_path / "out" / "init.txt").read_text() == "init ran\n"
    user = tmp_path / "user.smolfile"
    user.write_text('image = "minimal"\n[dev]\nuser = "nobody"\n')
    who = cli("run", "-s", str(user), "--", "id", "-un")
    assert who.returncode == 0 and who.stdout == "nobody\n", who.stderr
    ports = tmp_path / "ports.smolfile"
    ports.write_text('image = "minimal"\n[dev]\nports = ["8080:80"]\n')
    refused = cli("run", "-s", str(ports), "--", "true")
    assert refused.returncode == 2 and "[dev] ports is not supported" in refused.stderr


@pytest.mark.sandbox
def test_fleet_run_streams_output_and_returns_the_exit_code() -> None:
    """`fleet run` runs one machine from a Smolfile and passes the exit code through."""
    out = cli(
        "run", "-s", str(SMOLFILES / "minimal.smolfile"), "--", "sh", "-c", "echo streamed; exit 3"
    )
    assert out.returncode == 3
    assert out.stdout == "streamed\n"
    assert "runtime" in out.stderr


def test_generated_protos_match_the_contract() -> None:
    """Regenerating fleet/api/_proto from proto/ changes nothing."""
    out = subprocess.run(
        ["scripts/gen-protos", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "FLEET_SETUP_DONE": "1"},
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_image_pack_packs_where_microvms_boot_and_says_why_not_elsewhere(tmp_path: Path) -> None:
    """`fleet image pack` either writes the pack or refuses with the preflight's reason."""
    out = cli("image", "pack", "minimal", "--out", str(tmp_path / "m.smolmachine"), timeout=600)
    if out.returncode == 0:
        assert (tmp_path / "m.smolmachine").exists() and "packed" in out.stdout
    else:
        assert out.returncode == 1
        assert "microVMs cannot boot here:" in out.stderr, out.stderr
        assert not (tmp_path / "m.smolmachine").exists()


CHAT_STEP = r"""
import json, os, ssl, urllib.request
context = ssl.create_default_context(cadata=os.environ["FLEET_GATEWAY_CA"])
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={
        "Authorization": "Bearer " + key, "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60, context=context))
model = call("/models")["data"][0]["id"]
answer = call("/chat/completions", {"model": model, "temperature": 0, "max_tokens": 24,
              "messages": [{"role": "user", "content": "hello"}]})
print(json.dumps({"model": model, "served_by": answer["fleet"]["served_by"],
                  "tokens": answer["usage"]["completion_tokens"]}))
"""


@pytest.mark.sandbox
def test_up_with_its_gateway_serves_an_inference_rollout(tmp_path: Path) -> None:
    """`fleet up --gateway` starts the gateway with the shipped language model beside the
    embedded fleet: a rollout submitted with --inference calls its OpenAI-compatible API."""
    port = free_port()
    argv = [*FLEET, "up", "--gateway", "--listen", f"127.0.0.1:{port}",
            "--db", str(tmp_path / "ledger.sqlite3")]  # fmt: skip
    log = tmp_path / "fleet-up.log"
    env = {**os.environ, "FLEET_GATEWAY_LLM": "auto"}
    with (
        log.open("w") as err,
        subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, env=env
        ) as proc,  # fmt: skip
    ):
        assert proc.stdout is not None
        banner = [proc.stdout.readline(), proc.stdout.readline()]
        if not all("fleet up:" in line for line in banner):
            proc.kill()
            pytest.fail(f"fleet up --gateway did not start: {banner}{log.read_text()[-3000:]}")
        assert "language model fleet-tiny-chat-v1" in banner[1], banner
        plan = tmp_path / "plan.toml"
        plan.write_text(f"[[steps]]\nargv = ['python3', '-c', '''{CHAT_STEP}''']\n")
        server = f"127.0.0.1:{port}"
        minimal = str(SMOLFILES / "minimal.smolfile")
        submitted = cli("submit", "--server", server, "-s", minimal, "--plan", str(plan),
                        "--inference", "-q")  # fmt: skip
        done: dict[str, object] = {}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            got = cli("get", "--server", server, submitted.stdout.strip(), "--json")
            done = json.loads(got.stdout) if got.returncode == 0 else {}
            if done.get("state") in ("ROLLOUT_STATE_SUCCEEDED", "ROLLOUT_STATE_FAILED"):
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    assert done.get("state") == "ROLLOUT_STATE_SUCCEEDED", [
        base64.b64decode(r["stderr"])[-1500:]
        for r in done.get("results", [])  # type: ignore[attr-defined]
    ] or done
    results = done["results"]
    assert isinstance(results, list)
    seen = json.loads(base64.b64decode(results[0]["stdout"]))
    assert seen["model"] == "fleet-tiny-chat-v1" and seen["served_by"] == "primary"
    assert seen["tokens"] > 0
    assert proc.returncode == 0, log.read_text()[-2000:]
