"""The soak harness (``python -m batchgate.bench.soak``): a short run passes, and its checks can fail.

The 10-minute figures are for docs/benchmarks.md; here a few seconds prove that the harness drives
all three kinds of traffic, that the server's count of answers matches the client's, and that the
comparison catches a lost or extra answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchgate.bench.soak import Tally, compare_counts

# Slow (the soak harness drives a server for seconds): make test-fast leaves it out.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_soak_passes_with_every_kind_of_traffic(tmp_path):
    report_path = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "-m", "batchgate.bench.soak", "--seconds", "6", "--warmup-s", "2",
         "--concurrency", "4", "--quiet", "--json", str(report_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    report = json.loads(report_path.read_text())

    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert report["passed"] is True
    assert report["lost"] == 0 and report["wrong_answers"] == 0
    assert report["count_mismatches"] == []
    outcomes = report["outcomes"]
    assert sum(outcomes["valid"]["mlp"].values()) > 0
    invalid_codes = {code for per_model in outcomes["invalid"].values() for code in per_model}
    assert invalid_codes == {"INVALID_ARGUMENT", "NOT_FOUND"}
    assert sum(sum(c.values()) for c in outcomes["cancelled"].values()) > 0
    assert report["rss_final_bytes"] > 0
    assert "result                  PASS" in result.stdout


def _tally(**counts: int) -> Tally:
    tally = Tally()
    for key, n in counts.items():
        kind, model, status = key.split("__")
        for _ in range(n):
            tally.add(kind, model, status)
    return tally


def test_counts_match_when_the_server_answered_each_request_once():
    tally = _tally(valid__mlp__OK=10, invalid__mlp__INVALID_ARGUMENT=2, cancelled__mlp__CANCELLED=3)
    before = {("mlp", "OK"): 5.0}
    # Two of the cancelled calls were answered before the cancel reached the server.
    after = {("mlp", "OK"): 17.0, ("mlp", "INVALID_ARGUMENT"): 2.0, ("mlp", "CANCELLED"): 1.0}

    assert compare_counts(tally, before, after) == []


def test_a_lost_answer_and_an_extra_error_are_reported():
    tally = _tally(valid__mlp__OK=10, invalid__cnn__INVALID_ARGUMENT=2)
    after = {("mlp", "OK"): 9.0, ("cnn", "INVALID_ARGUMENT"): 2.0, ("cnn", "INTERNAL"): 1.0}

    problems = compare_counts(tally, {}, after)

    assert any(p.startswith("mlp OK: server counted 9") for p in problems)
    assert any(p.startswith("cnn INTERNAL: server counted 1") for p in problems)
