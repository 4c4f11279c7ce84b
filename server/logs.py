"""structlog set-up: JSON lines in production, readable key-value lines in a terminal."""

from __future__ import annotations

import json
import logging
import sys

import structlog

LOG_FORMATS = ("auto", "json", "console")


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level, got {level!r}")
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")


def announce(event: str, **fields) -> None:
    """A JSON line on stderr whatever the log level: how child processes tell the supervisor
    they are ready (``executor_ready``, ``frontend_ready``)."""
    print(json.dumps({"event": event, **fields}), file=sys.stderr, flush=True)
