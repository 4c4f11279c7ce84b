"""The run's table: rows as they come, each section's time budget, and the run's limits."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

# scripts/gpu-check.sh installs its wheels and runs this in one call of under 8 minutes.
HARD_LIMIT_S = 450.0  # the watchdog prints the table so far and exits 3
SOFT_LIMIT_S = 400.0  # no section starts after this


PASS, FAIL, INFO, SKIP, ERROR = "PASS", "FAIL", "INFO", "SKIP", "ERROR"
# A target's verdict (``targets.py``): never MET for a figure that was not measured.
MET, NOT_MET, UNMEASURED = "MET", "NOT MET", "UNMEASURED"


@dataclasses.dataclass
class Row:
    section: str
    check: str
    result: str
    status: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


class Report:
    """Rows as they come (each printed at once), section timings, and the final table."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.sections: dict[str, dict[str, Any]] = {}
        self.machine: dict[str, Any] = {}
        # target -> why its figure could not be measured, said where that was found out
        self.unmeasured_reasons: dict[str, list[str]] = {}
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def add(self, section: str, check: str, result: str, status: str, **data: Any) -> Row:
        row = Row(section, check, result, status, data)
        with self._lock:
            self.rows.append(row)
        say(f"  [{section}] {check}: {result}  {status}")
        return row

    def unmeasured(self, target: str, reason: str) -> None:
        """Record why ``target``'s figure could not be measured (its row says so at the end)."""
        with self._lock:
            self.unmeasured_reasons.setdefault(target, []).append(reason)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def correctness_failed(self) -> bool:
        return any(r.section == "a" and r.status in (FAIL, ERROR) for r in self.rows)

    def table(self) -> str:
        with self._lock:
            rows = list(self.rows)
        width = min(44, max([len(r.check) for r in rows] + [5]))
        lines = [f"{'':2}{'check':<{width}}  {'status':<9}  result"]
        for section in [*"abcdet", "targets", "run"]:
            chosen = [r for r in rows if r.section == section]
            if not chosen:
                continue
            timing = self.sections.get(section, {}).get("elapsed_s")
            spent = f" ({timing:.1f} s)" if timing is not None else ""
            lines.append(f"({section}) {SECTION_TITLES[section]}{spent}")
            lines.extend(f"{'':2}{r.check:<{width}}  {r.status:<9}  {r.result}" for r in chosen)
        return "\n".join(lines)

    def to_json(self, exit_code: int | None) -> dict[str, Any]:
        with self._lock:
            rows = [dataclasses.asdict(r) for r in self.rows]
        return {"machine": self.machine, "sections": self.sections, "rows": rows,
                "elapsed_s": round(self.elapsed(), 2), "exit_code": exit_code}


SECTION_TITLES = {
    "a": "correctness: served on the device vs the CPU in fp32",
    "b": "memory: in use / reserved on a mixed multi-model trace",
    "c": "throughput: in-process loop vs the whole gateway",
    "d": "host-to-device time on the critical path",
    "e": "GPU busy % under load (NVML)",
    "t": "pytest -m cuda on this machine",
    "targets": "the GPU targets, each from the figures above or unmeasured and why",
    "run": "the run as a whole",
}


def say(text: str) -> None:
    print(text, flush=True)


class Budget:
    """A section's time allowance; the run's soft limit caps it too."""

    def __init__(self, report: Report, seconds: float) -> None:
        self._deadline = min(time.monotonic() + seconds, report.started + SOFT_LIMIT_S)

    def left(self) -> float:
        return self._deadline - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0


def run_section(report: Report, section: str, budget_s: float,
                body: Callable[[Report, Budget], None]) -> None:
    """Run one section; an exception becomes an ERROR row and the run goes on."""
    started = time.monotonic()
    say(f"({section}) {SECTION_TITLES[section]}: budget {budget_s:.0f} s, "
        f"run at {report.elapsed():.0f} s")
    info: dict[str, Any] = {"budget_s": budget_s}
    report.sections[section] = info
    if report.elapsed() >= SOFT_LIMIT_S:
        report.add(section, "section", f"not run: the run passed its {SOFT_LIMIT_S:.0f} s limit",
                   SKIP)
    else:
        try:
            body(report, Budget(report, budget_s))
        except Exception as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"
            info["traceback"] = traceback.format_exc()
            sys.stderr.write(info["traceback"])
            report.add(section, "section", f"raised {chain(exc)}", ERROR)
    info["elapsed_s"] = round(time.monotonic() - started, 2)
    say(f"({section}) done in {info['elapsed_s']:.1f} s")


def summary(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()
    first = text[0].strip() if text else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def chain(exc: BaseException) -> str:
    """The exception and what caused it: the project's errors keep details out of messages."""
    parts = [summary(exc)]
    cause = exc.__cause__ or exc.__context__
    while cause is not None and len(parts) < 3:
        parts.append(summary(cause, 200))
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(parts)

