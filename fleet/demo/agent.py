"""The LLM agent of one evaluation episode; it runs inside the episode's machine.

Standard library only: the machine's python3 has no `openai` package, so this speaks the
gateway's OpenAI-compatible API (POST /v1/chat/completions, `Authorization: Bearer` with the
rollout's inference token) with `http.client`, as the official client would. It reaches the
gateway at FLEET_GATEWAY: `unix:PATH` in a warm parent's child (no network of its own; the
agent splices the socket to the gateway), `https://HOST:PORT` (checked against the fleet's CA,
FLEET_GATEWAY_CA) or `HOST:PORT` elsewhere. OPENAI_BASE_URL is not used because a warm
parent's child has no address it could name.

The loop: the task's files are written into a fresh working directory (its path the same in
every run); the model is asked the question with the `shell` tool offered; each tool call runs
here, with `sh -c` in that directory, and its output goes back as the tool's message; the
first answer without a tool call ends the episode, and so does the turn limit. Decoding is
greedy, so an attempt retried after a lost host asks the same questions and gets the same
answers.

A random agent answers the same task in the same directory, for the suite's random baseline:
it runs a command drawn from the tool's vocabulary (instantiated with the task's file names)
and answers with a token drawn from that command's output. It calls no model.

`run_task(task)` returns one JSON-ready dict: the answer, the turns, the commands, the tokens
the gateway's `usage` counted, each model call's latency, and the random agent's answers. The
host scores both (`fleet.demo.tasks.score`): the machine never sees the expected answer.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command and return its standard output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command line"}},
            "required": ["command"],
        },
    },
}
"""The tool the shipped model was trained to call (gateway.llm.chat.SHELL_TOOL; the demo's
test checks the two are the same, since this module cannot import the gateway)."""
MAX_TURNS = 4
"""Model calls per episode: a tool call, its answer, and room for a second try."""
MAX_TOKENS = 96
"""Completion tokens per model call: a tool call or an answer is well under it."""
TOOL_OUTPUT_CHARS = 400
"""What a tool's message keeps of its output (the model's context is 512 tokens)."""
TOOL_TIMEOUT_S = 10.0
RETRIES = 40
"""Model calls refused for capacity (429) or a failing device (503) are retried this often,
after the gateway's Retry-After."""
RANDOM_DRAWS = 8
VOCABULARY = (
    "ls", "ls {dir}", "ls | wc -l", "ls {dir} | wc -l", "pwd", "cat {file}", "head -n 1 {file}",
    "tail -n 1 {file}", "wc -l {file}", "wc -w {file}", "sort {file}", "grep -c {word} {file}",
    "echo {words}", "echo {words} | wc -w", "echo {words} | tr a-z A-Z", "expr {n} + {m}",
)  # fmt: skip
"""The random agent's commands; {file}, {dir}, {word}, {words}, {n}, {m} are drawn from the
task's files and question."""


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (how a warm parent's child reaches the gateway)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


def connection(where: str, timeout: float = 60.0) -> http.client.HTTPConnection:
    """A connection to the gateway at FLEET_GATEWAY's address."""
    if where.startswith("unix:"):
        return _UnixConnection(where.removeprefix("unix:"), timeout)
    if where.startswith("https://"):
        import ssl

        context = ssl.create_default_context(cadata=os.environ["FLEET_GATEWAY_CA"])
        context.check_hostname = False  # a machine reaches the gateway at an unlisted address
        host, _, port = where.removeprefix("https://").rpartition(":")
        return http.client.HTTPSConnection(host.strip("[]"), int(port), timeout=timeout,
                                           context=context)  # fmt: skip
    host, _, port = where.removeprefix("http://").rpartition(":")
    return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)


class Gateway:
    """The gateway's chat completions, on one kept-alive connection."""

    def __init__(self, where: str, token: str) -> None:
        self.where, self.token = where, token
        self.conn: http.client.HTTPConnection | None = None
        self.retried = 0

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        data = json.dumps(body).encode()
        headers = {"Authorization": "Bearer " + self.token, "Content-Type": "application/json"}
        for attempt in (1, 2):  # a kept-alive connection the gateway closed: once more, anew
            if self.conn is None:
                self.conn = connection(self.where)
            try:
                self.conn.request("POST", path, data, headers)
                reply = self.conn.getresponse()
                payload = reply.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
                continue
            if reply.getheader("connection", "").lower() == "close":
                self.conn.close()
                self.conn = None
            return reply.status, {k.lower(): v for k, v in reply.getheaders()}, payload
        raise AssertionError("unreachable")

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion; refusals for capacity or a failing device are waited out."""
        for _ in range(RETRIES):
            status, headers, payload = self._post("/v1/chat/completions", body)
            if status == 200:
                answer: dict[str, Any] = json.loads(payload)
                return answer
            if status not in (429, 503):
                raise RuntimeError(f"the gateway answered {status}: {payload[:300]!r}")
            self.retried += 1
            time.sleep(min(5.0, float(headers.get("retry-after", "0.2") or 0.2)))
        raise RuntimeError(f"the gateway refused {RETRIES} times in a row")


def write_files(root: Path, files: dict[str, str]) -> None:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def run_tool(command: str, cwd: Path) -> str:
    """The command's output as the tool's message: stdout, else stderr, cut to fit."""
    try:
        done = subprocess.run(["sh", "-c", command], cwd=cwd, capture_output=True, text=True,
                              timeout=TOOL_TIMEOUT_S, errors="replace")  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"(timed out after {TOOL_TIMEOUT_S:g} s)"
    out = done.stdout if done.stdout.strip() else done.stderr
    return out.rstrip("\n")[:TOOL_OUTPUT_CHARS]


def agent_loop(gateway: Gateway, model: str, task: dict[str, Any], cwd: Path) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    commands: list[str] = []
    latencies_ms: list[float] = []
    prompt_tokens = completion_tokens = 0
    answer, ended = None, "turn_limit"
    for _ in range(MAX_TURNS):
        asked = time.monotonic()
        reply = gateway.chat({"model": model, "messages": messages, "tools": [SHELL_TOOL],
                              "temperature": 0, "max_tokens": MAX_TOKENS})  # fmt: skip
        latencies_ms.append(round(1000 * (time.monotonic() - asked), 3))
        usage = reply.get("usage") or {}
        prompt_tokens += int(usage.get("prompt_tokens", 0))
        completion_tokens += int(usage.get("completion_tokens", 0))
        message = reply["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        if not calls:
            answer, ended = message.get("content") or "", "answered"
            break
        call = calls[0]
        try:
            command = str(json.loads(call["function"]["arguments"])["command"])
        except (ValueError, KeyError, TypeError):
            answer, ended = None, "malformed_tool_call"
            break
        commands.append(command)
        output = run_tool(command, cwd)
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call.get("id", "call_0"),
                         "content": output})  # fmt: skip
    return {"answer": answer, "ended": ended, "turns": len(latencies_ms), "commands": commands,
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "latencies_ms": latencies_ms, "retried_calls": gateway.retried}  # fmt: skip


def random_answers(task: dict[str, Any], cwd: Path, seed: int) -> list[str]:
    """What the random agent answers in RANDOM_DRAWS tries: each a random command from
    VOCABULARY run here, then a random token of its output (of the question, if none)."""
    rng = random.Random(seed)
    files = sorted(task["files"]) or ["notes.txt"]
    dirs = sorted({f.rpartition("/")[0] for f in files if "/" in f}) or ["."]
    words = [w.strip("'\",.?:") for w in task["question"].split()]
    words = [w for w in words if w] or ["x"]
    out = []
    for _ in range(RANDOM_DRAWS):
        command = rng.choice(VOCABULARY).format(
            file=shlex.quote(rng.choice(files)), dir=shlex.quote(rng.choice(dirs)),
            word=shlex.quote(rng.choice(words)),
            words=shlex.quote(" ".join(rng.sample(words, min(len(words), 3)))),
            n=rng.randint(0, 999), m=rng.randint(0, 999),
        )  # fmt: skip
        tokens = run_tool(command, cwd).split() or task["question"].split()
        out.append(rng.choice(tokens))
    return out


def run_task(task: dict[str, Any]) -> dict[str, Any]:
    """One episode: the task's files, the agent's loop, the random agent's answers."""
    gateway = Gateway(os.environ["FLEET_GATEWAY"], os.environ["FLEET_INFERENCE_TOKEN"])
    started = time.monotonic()
    # A fixed directory (the machine is the episode's own): what `pwd` shows, and so what
    # either agent may answer, is the same in every run.
    cwd = Path(tempfile.gettempdir()) / f"task-{task['name']}"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    try:
        write_files(cwd, task["files"])
        result = agent_loop(gateway, task["model"], task, cwd)
        result["random_answers"] = random_answers(task, cwd, task.get("seed", 0))
    finally:
        shutil.rmtree(cwd, ignore_errors=True)
    result["name"] = task["name"]
    result["rollout_id"] = os.environ.get("FLEET_ROLLOUT_ID", "")
    result["attempt"] = int(os.environ.get("FLEET_ATTEMPT", "1") or 1)
    result["wall_ms"] = round(1000 * (time.monotonic() - started), 3)
    return result


def source() -> str:
    """This module's source: what an episode's warm-up loads."""
    return Path(__file__).read_text()


def episode_step() -> list[str]:
    """The episode's argv after a warm-up of `source()`: the task comes in FLEET_TASK."""
    return ["python3", "-c", "print(json.dumps(run_task(json.loads(os.environ['FLEET_TASK']))),"
            " flush=True)"]  # fmt: skip
