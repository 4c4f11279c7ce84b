"""The run's child processes: started here, killed together when the watchdog fires."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from typing import Any

from batchgate.bench.gpu_check.samples import ROOT

_children: list[subprocess.Popen] = []
_children_lock = threading.Lock()


def gpu_check_command(*flags: str) -> list[str]:
    """This check run again as a child (in the repository root, as ``run_child`` starts it)."""
    return [sys.executable, "-m", "batchgate.bench.gpu_check", *flags]


def run_child(command: list[str], *, env: dict[str, str] | None, timeout_s: float
              ) -> subprocess.CompletedProcess:
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT) as proc:
        with _children_lock:
            _children.append(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        finally:
            with _children_lock:
                _children.remove(proc)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def marked_json(text: str, marker: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    return None


def kill_children() -> None:
    """Kill every child still running (the watchdog's last act)."""
    with _children_lock:
        for proc in _children:
            with contextlib.suppress(Exception):
                proc.kill()
