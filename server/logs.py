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
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries' lines (asyncio, grpc) in the same format: a JSON log stays all JSON.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def runtime_facts() -> dict[str, object]:
    """What this Python process runs with, as the settings made it: in the ready lines, so
    that tests and operators see the effect, not only the flag."""
    import gc

    return {"gc_frozen": gc.get_freeze_count() > 0, "switch_interval_s": sys.getswitchinterval()}


def announce(event: str, **fields) -> None:
    """A JSON line on stderr whatever the log level: how child processes tell the supervisor
    they are ready (``executor_ready``, ``frontend_ready``)."""
    print(json.dumps({"event": event, **fields}), file=sys.stderr, flush=True)
