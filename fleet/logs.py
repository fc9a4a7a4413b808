"""structlog set-up for the command line: one event per line on stderr.

JSON lines when stderr is not a terminal (a service's log, a pipe, a file), readable lines on a
terminal; `FLEET_LOG_FORMAT=json` or `console` decides instead. The standard library's logging
(grpc, sqlalchemy, asyncio, urllib3) goes through the same processors and renderer, so a
process writes one format; context bound with structlog's contextvars (`rpc`, `request_id` in
the server) is on every line, its libraries' included.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

FORMATS = ("json", "console")


def log_format(stream: Any = None) -> str:
    """`json` or `console`: `FLEET_LOG_FORMAT`, else whether `stream` is a terminal."""
    chosen = os.environ.get("FLEET_LOG_FORMAT", "").strip().lower()
    if chosen:
        if chosen not in FORMATS:
            raise SystemExit(f"FLEET_LOG_FORMAT={chosen!r}: expected json or console")
        return chosen
    stream = stream if stream is not None else sys.stderr
    return "console" if stream.isatty() else "json"


def configure(level: str = "info") -> None:
    numeric = getattr(logging, level.upper(), logging.INFO)
    json_lines = log_format() == "json"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso" if json_lines else "%H:%M:%S", utc=json_lines),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if json_lines
        else structlog.dev.ConsoleRenderer(colors=False)
    )  # fmt: skip
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.format_exc_info if json_lines else structlog.dev.set_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # Libraries that talk a lot at INFO: their warnings and errors are what an operator needs.
    # (alembic says so at INFO every time a ledger opens; fleet logs each migration it applies.)
    for chatty in ("sqlalchemy", "alembic", "urllib3", "httpx", "httpcore", "aiohttp", "asyncio"):
        logging.getLogger(chatty).setLevel(max(numeric, logging.WARNING))
