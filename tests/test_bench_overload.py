"""The overload benchmark (``python -m batchgate.bench.overload``) runs, and tells the two servers apart.

Its figures are for docs/benchmarks.md; here a short run shows that the harness measures a
capacity, overloads it, and that admission control is what refuses requests at once: with it the
server answers RESOURCE_EXHAUSTED, without it (``admission: false``) it never does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_overload_run_refuses_only_with_admission_control(tmp_path):
    report_path = tmp_path / "overload.json"
    result = subprocess.run(
        [sys.executable, "-m", "batchgate.bench.overload", "--synthetic-ms", "80,6", "--deadline-ms", "1000",
         "--seconds", "3", "--json", str(report_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())

    assert report["capacity_per_s"] > 0
    # Capacity counts the answers within the window: the calls started in it less each of the
    # 64 clients' last one, which ends after it.
    closed = report["admission"]["capacity_step"]
    assert report["capacity_per_s"] == pytest.approx((closed["ok"] - 64) / 3)
    with_admission = report["admission"]["overload_step"]
    without = report["no_admission"]["overload_step"]
    assert with_admission["offered_per_s"] > 3 * report["capacity_per_s"]
    assert with_admission["errors"].get("RESOURCE_EXHAUSTED", 0) > 0
    assert "RESOURCE_EXHAUSTED" not in without["errors"]
    assert "goodput / capacity" in result.stdout
