"""Run Triton's ``perf_analyzer`` at one concurrency and read back its CSV.

``perf_analyzer -f FILE`` writes one header line and one row per concurrency. The columns of
2.51 that matter here (latencies in microseconds)::

    Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,
    Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,
    p50 latency,p90 latency,p95 latency,p99 latency[,request/response,response wait]

The "Server ..." columns come from the server's ModelStatistics, averaged per request. When a
measurement does not stabilise within ``--max-trials`` windows, perf_analyzer exits 2 and writes
no CSV; :func:`run_perf_analyzer` then retries once with a looser stability percentage.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PERF_ANALYZER = ROOT / "scripts" / "perf_analyzer"
INSTALL_HINT = "install it with: bash scripts/install-perf-analyzer.sh"

# CSV column -> field of PerfRow, with the scale to milliseconds where the column is in µs.
_COLUMNS = {
    "Concurrency": ("concurrency", None),
    "Inferences/Second": ("throughput_per_s", None),
    "p50 latency": ("p50_ms", 1e-3),
    "p90 latency": ("p90_ms", 1e-3),
    "p95 latency": ("p95_ms", 1e-3),
    "p99 latency": ("p99_ms", 1e-3),
    "Client Send": ("client_send_ms", 1e-3),
    "Network+Server Send/Recv": ("network_ms", 1e-3),
    "Server Queue": ("server_queue_ms", 1e-3),
    "Server Compute Input": ("server_compute_input_ms", 1e-3),
    "Server Compute Infer": ("server_compute_infer_ms", 1e-3),
    "Server Compute Output": ("server_compute_output_ms", 1e-3),
    "Client Recv": ("client_recv_ms", 1e-3),
}
_REQUIRED = ("Concurrency", "Inferences/Second", "p50 latency", "p99 latency")


@dataclasses.dataclass(frozen=True)
class PerfRow:
    """One concurrency level of a perf_analyzer CSV; latencies in milliseconds."""

    concurrency: int
    throughput_per_s: float
    p50_ms: float
    p99_ms: float
    p90_ms: float | None = None
    p95_ms: float | None = None
    client_send_ms: float | None = None
    network_ms: float | None = None
    server_queue_ms: float | None = None
    server_compute_input_ms: float | None = None
    server_compute_infer_ms: float | None = None
    server_compute_output_ms: float | None = None
    client_recv_ms: float | None = None


@dataclasses.dataclass(frozen=True)
class PerfRun:
    row: PerfRow
    stability_percentage: float
    wall_s: float
    cpu_s: float  # perf_analyzer's own user + system time: the load generator shares the cores
    command: list[str]


class PerfAnalyzerError(RuntimeError):
    pass


def parse_perf_analyzer_csv(text: str) -> list[PerfRow]:
    """The rows of a ``perf_analyzer -f`` CSV, up to the first blank line.

    Later sections (GPU metrics with ``--collect-metrics``) follow a blank line and are skipped.
    """
    table = text.split("\n\n", 1)[0].strip()
    reader = csv.DictReader(io.StringIO(table))
    header = reader.fieldnames or []
    missing = [name for name in _REQUIRED if name not in header]
    if missing:
        raise PerfAnalyzerError(
            f"perf_analyzer CSV lacks the column(s) {', '.join(missing)}; got header {header}"
        )
    rows = []
    for record in reader:
        fields: dict[str, float | int] = {}
        for column, (name, scale) in _COLUMNS.items():
            raw = (record.get(column) or "").strip()
            if not raw:
                continue
            value = float(raw)
            fields[name] = value * scale if scale is not None else value
        fields["concurrency"] = int(fields["concurrency"])
        rows.append(PerfRow(**fields))
    if not rows:
        raise PerfAnalyzerError("perf_analyzer CSV has a header but no rows")
    return rows


def run_perf_analyzer(
    *,
    url: str,
    model: str,
    concurrency: int,
    measurement_interval_ms: int,
    perf_analyzer: Path = DEFAULT_PERF_ANALYZER,
    max_trials: int = 6,
    stability_percentages: tuple[float, ...] = (20.0, 40.0),
    timeout_s: float = 120.0,
    extra_args: tuple[str, ...] = (),
) -> PerfRun:
    """One closed-loop gRPC measurement at ``concurrency``; retried at looser stabilities.
    ``extra_args``: further perf_analyzer flags (``--shared-memory system`` ...). The run's wall
    and CPU seconds span every attempt, as a caller's readings around this call do."""
    if not os.access(perf_analyzer, os.X_OK):
        raise PerfAnalyzerError(f"perf_analyzer not found at {perf_analyzer}; {INSTALL_HINT}")
    failures = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-pa-") as scratch:
        for attempt, stability in enumerate(stability_percentages):
            csv_path = Path(scratch) / f"c{concurrency}-{attempt}.csv"
            command = [
                str(perf_analyzer), "-i", "grpc", "-u", url, "-m", model,
                "--concurrency-range", f"{concurrency}:{concurrency}",
                "--measurement-interval", str(measurement_interval_ms),
                "--max-trials", str(max_trials),
                "--stability-percentage", f"{stability:g}",
                "-f", str(csv_path), *extra_args,
            ]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                failures.append(f"stability {stability:g}%: no result within {timeout_s:g} s")
                continue
            wall_s = time.monotonic() - started
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if done.returncode == 0 and csv_path.is_file():
                rows = parse_perf_analyzer_csv(csv_path.read_text(encoding="utf-8"))
                cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                return PerfRun(rows[0], stability, wall_s, cpu_s, command)
            tail = (done.stdout + done.stderr).strip().splitlines()[-2:]
            failures.append(f"stability {stability:g}%: exit {done.returncode}: {' / '.join(tail)}")
    raise PerfAnalyzerError(
        f"perf_analyzer at concurrency {concurrency} gave no result: " + "; ".join(failures)
    )
