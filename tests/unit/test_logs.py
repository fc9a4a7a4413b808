"""One log format per process: JSON lines off a terminal, the standard library's loggers
included, with the context the server binds per call."""

from __future__ import annotations

import json
import logging

import pytest
import structlog

from fleet import logs


@pytest.fixture(autouse=True)
def restored() -> object:
    """The process's logging as it was (other tests log with structlog's defaults)."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield None
    structlog.configure(**config)
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_bound_context_and_the_libraries_records(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_LOG_FORMAT", "json")
    logs.configure("info")
    with structlog.contextvars.bound_contextvars(rpc="SubmitRollout", request_id="r-1"):
        structlog.get_logger("fleet.test").info("rollout_submitted", rollout_id="r-abc")
        logging.getLogger("grpc._cython").warning("a library said %s", "this")
    structlog.get_logger("fleet.test").debug("not_shown")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [line["event"] for line in lines] == ["rollout_submitted", "a library said this"]
    assert all(line["rpc"] == "SubmitRollout" and line["request_id"] == "r-1" for line in lines)
    assert lines[0]["rollout_id"] == "r-abc" and lines[0]["level"] == "info"
    assert lines[1]["level"] == "warning" and lines[1]["logger"] == "grpc._cython"


def test_the_format_follows_the_terminal_unless_told() -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

    class Pipe:
        def isatty(self) -> bool:
            return False

    with pytest.MonkeyPatch.context() as m:
        m.delenv("FLEET_LOG_FORMAT", raising=False)
        assert (logs.log_format(Tty()), logs.log_format(Pipe())) == ("console", "json")
        m.setenv("FLEET_LOG_FORMAT", "console")
        assert logs.log_format(Pipe()) == "console"
        m.setenv("FLEET_LOG_FORMAT", "xml")
        with pytest.raises(SystemExit, match="expected json or console"):
            logs.log_format(Pipe())
