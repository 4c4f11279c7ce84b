"""The machine a benchmark ran on, and the CPU time of processes and threads, read from
``/proc`` around each load step."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

import grpc

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def machine() -> dict[str, Any]:
    cpu_model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }


def _stat_fields(pid: int, task: Path | None = None) -> list[str]:
    text = ((task or Path(f"/proc/{pid}")) / "stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return text[text.rindex(")") + 2:].split()


def process_tree(pid: int) -> dict[int, str]:
    """``pid`` and its live descendants, each with its role: supervisor / executor / frontend
    (the server of one process: "server")."""
    children = _children()
    roles, todo = {}, [pid]
    while todo:
        current = todo.pop()
        try:
            command = Path(f"/proc/{current}/cmdline").read_bytes()
        except OSError:
            continue
        if b"batchgate.server.executor.process" in command:
            roles[current] = "executor"
        elif b"batchgate-frontend" in command:
            roles[current] = "frontend"
        else:
            roles[current] = "supervisor"
        todo.extend(children.get(current, ()))
    if len(roles) == 1:
        roles[pid] = "server"
    return roles


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid``, by ``name:tid``."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = _stat_fields(int(task.name), task)
            name = (task / "comm").read_text().strip()
        except (OSError, ValueError):
            continue
        threads[f"{name}:{task.name}"] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return threads


def _children() -> dict[int, list[int]]:
    """Every process's children, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(entry.name))[1]), []).append(int(entry.name))
            except (OSError, ValueError):
                continue
    return children


def process_cpu_s(pid: int, descendants: bool = True) -> float:
    """User + system CPU seconds of ``pid`` (and of its live descendants: the multi-process
    server's executor and front ends), all threads, from ``/proc/PID/stat``."""
    children = _children() if descendants else {}
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = _stat_fields(current)
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # proc(5) fields 14, 15
        todo.extend(children.get(current, ()))
    return total


def machine_busy_s() -> float:
    """CPU seconds all processes have used since boot (``/proc/stat``), idle and iowait left out."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice, already inside user/nice]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _CLOCK_TICKS
