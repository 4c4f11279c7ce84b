"""(t) ``pytest -m cuda`` on the same machine, in the same call."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from batchgate.bench.gpu_check.children import run_child
from batchgate.bench.gpu_check.report import ERROR, FAIL, PASS, SKIP, Budget, Report
from batchgate.bench.gpu_check.samples import ROOT


def section_pytest(report: Report, budget: Budget) -> None:
    """``pytest -m cuda`` on this machine, within the section's budget."""
    if importlib.util.find_spec("pytest") is None:
        report.add("t", "pytest -m cuda", "pytest is not installed here (carry its wheels)", SKIP)
        return
    if not (ROOT / "tests").is_dir():
        report.add("t", "pytest -m cuda", f"no test tree in {ROOT} (an installed batchgate, or "
                   "a checkout without tests/)", SKIP)
        return
    timeout = budget.left()
    # The test that runs this check is left out: it would run this section again.
    # Only the files that hold cuda tests: the others need packages the machine may lack.
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                   if "mark.cuda" in path.read_text())
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider",
               "--deselect", "tests/test_gpu_check.py::test_full_run_on_cuda", *files]
    try:
        out = run_child(command, env=dict(os.environ), timeout_s=timeout)
    except subprocess.TimeoutExpired:
        report.add("t", "pytest -m cuda", f"ran past {timeout:.0f} s", ERROR)
        return
    lines = [line for line in out.stdout.strip().splitlines() if line.strip()]
    summary = lines[-1] if lines else "no output"
    # Every test skipped (no device, or it lacks what they need) is no pass: the reasons follow.
    ran = " passed" in summary or " failed" in summary
    status = (FAIL if out.returncode != 0 else PASS if ran else SKIP)
    skipped = [line for line in lines if line.startswith("SKIPPED")]
    report.add("t", "pytest -m cuda", summary + (f"; {skipped[0]}" if skipped and not ran else ""),
               status, returncode=out.returncode, skipped=skipped, tail=lines[-30:])


