"""Outside tools the tests run, and whether they run here."""

from __future__ import annotations

import subprocess

from tests.support import ROOT

# Triton's perf_analyzer, installed by `make tools` (scripts/install-perf-analyzer.sh).
PERF_ANALYZER = ROOT / "scripts" / "perf_analyzer"


def perf_analyzer_unavailable() -> str | None:
    """None if perf_analyzer runs here, else the reason it does not (for a skip)."""
    if not PERF_ANALYZER.exists() or not (ROOT / ".tools" / "perf_analyzer" / "bin").exists():
        return "perf_analyzer is not installed (make test runs scripts/install-perf-analyzer.sh)"
    probe = subprocess.run([str(PERF_ANALYZER), "--version"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"perf_analyzer does not run here: {probe.stderr.strip()[:200]}"
    return None


# For tests that judge perf_analyzer's run by its errors, never by its figures: it stops once
# three windows agree within this many percent of each other (max / min), or fails after
# --max-trials. At 1000 % any three windows agree, so a noisy machine cannot fail such a test
# (50 % did: "Failed to obtain stable measurement within 6 measurement windows").
PERF_ANALYZER_ANY_STABILITY = ["--stability-percentage", "1000"]
