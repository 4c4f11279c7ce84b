"""The children's logs, forwarded into the supervisor's one stream.

Children log JSON lines on stderr; a thread per child reads them (``ChildLogs.read``) and
forwards each line as it comes, so the server's log stays one stream. Children log at info at
least, since their ready lines are info lines; lines below the level asked for are dropped
here, and for a terminal the lines are rendered here too (children always write JSON).
Only what must be looked at is parsed: every line when lines are filtered or rendered,
otherwise only a line that may be a ready line.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Callable
from typing import BinaryIO

import structlog

from batchgate.server.logs import write_stderr_bytes

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class ChildLogs:
    """Forwards child log lines to ``stream`` (default: this process's stderr, chosen at
    ``open``), at ``log_level`` and in ``log_format`` (json, console or auto)."""

    def __init__(self, log_level: str, log_format: str, stream: BinaryIO | None = None) -> None:
        if str(log_level).upper() not in LOG_LEVELS:
            raise ValueError(f"unknown log level, got {log_level!r}")
        self._format = log_format
        self._stream = stream
        self._renderer = None
        self._level = _level_number(log_level)
        self._lock = threading.Lock()
        self._write = self._write_stream
        self.child_log_level = log_level if self._level <= logging.INFO else "info"
        """The level children are told to log at."""

    def open(self) -> None:
        """Pick the stream and how lines are rendered; before the first child starts."""
        if self._stream is None:  # this process's stderr, shared with its own log lines
            self._stream = sys.stderr.buffer
            self._write = write_stderr_bytes
        if _resolve_format(self._format, self._stream) == "console":
            self._renderer = structlog.dev.ConsoleRenderer(colors=_isatty(self._stream))

    def read(self, lines: BinaryIO, ready_event: str, on_ready: Callable[[dict], None]) -> None:
        """Forward every line of ``lines`` until it ends, and call ``on_ready`` with the
        ``ready_event`` line's fields when it comes. Closes ``lines``."""
        parse_all = self._renderer is not None or self._level > logging.INFO
        try:
            for line in lines:
                event = _parse(line) if parse_all or b"_ready" in line else None
                if event is None or _level_number(event.get("level")) >= self._level:
                    self._forward(line, event)
                if event is not None and event.get("event") == ready_event:
                    on_ready(event)
        finally:
            lines.close()

    def _forward(self, line: bytes, event: dict | None) -> None:
        if not line.endswith(b"\n"):
            line += b"\n"
        if self._renderer is not None and event is not None:
            line = (self._renderer(None, "", dict(event)) + "\n").encode()
        try:
            self._write(line)
        except (OSError, ValueError):
            pass  # our stderr is gone; keep reading so the child never blocks on the pipe

    def _write_stream(self, line: bytes) -> None:
        with self._lock:
            self._stream.write(line)
            self._stream.flush()


def _level_number(level) -> int:
    """``logging``'s number for a level name; lines without a known level are always shown."""
    if not isinstance(level, str):
        return logging.CRITICAL + 1
    number = logging.getLevelName(level.upper())
    return number if isinstance(number, int) else logging.CRITICAL + 1


def _parse(line: bytes) -> dict | None:
    if not line.startswith(b"{"):
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _resolve_format(fmt: str, stream) -> str:
    if fmt == "auto":
        return "console" if _isatty(stream) else "json"
    return fmt
