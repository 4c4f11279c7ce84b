"""structlog set-up: JSON lines in production, readable key-value lines in a terminal."""

from __future__ import annotations

import json
import logging
import sys
import threading

import structlog

LOG_FORMATS = ("auto", "json", "console")

_STDERR_LOCK = threading.RLock()  # re-entrant: a signal handler may log mid-write


class _StderrLines:
    """This process's stderr, one whole line per ``write`` across every thread.

    structlog's loggers, the stdlib handler, ``announce`` and the supervisor's forwarding
    of child lines all write through it; each of them holding a lock of its own let two
    lines interleave into one that is not JSON. ``sys.stderr`` is looked up at each write, so
    a redirect made after ``configure_logging`` still applies."""

    def write(self, text: str) -> int:
        with _STDERR_LOCK:
            written = sys.stderr.write(text)
            sys.stderr.flush()
        return written

    def flush(self) -> None:
        pass  # every write is flushed under the lock


STDERR = _StderrLines()


def write_stderr_bytes(line: bytes) -> None:
    """One already-encoded line (a child's) to stderr, between other threads' lines."""
    with _STDERR_LOCK:
        sys.stderr.flush()
        buffer = getattr(sys.stderr, "buffer", None)
        if buffer is None:  # a text-only stream (a test's capture)
            sys.stderr.write(line.decode("utf-8", "replace"))
        else:
            buffer.write(line)
            buffer.flush()


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
        logger_factory=structlog.WriteLoggerFactory(file=STDERR),
        cache_logger_on_first_use=True,
    )
    # Libraries' lines (asyncio, grpc) in the same format: a JSON log stays all JSON.
    handler = logging.StreamHandler(STDERR)
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

    from batchgate.batcher import scheduling

    return {"gc_frozen": gc.get_freeze_count() > 0, "switch_interval_s": sys.getswitchinterval(),
            "scheduling": scheduling.current()}


def announce(event: str, **fields) -> None:
    """A JSON line on stderr whatever the log level: how child processes tell the supervisor
    they are ready (``executor_ready``, ``frontend_ready``)."""
    STDERR.write(json.dumps({"event": event, **fields}) + "\n")
