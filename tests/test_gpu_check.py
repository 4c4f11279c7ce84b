"""`python -m batchgate.bench.gpu_check` as it is run: a real process, without a GPU here, on one where there
is one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()


def run_check(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgate.bench.gpu_check", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.skipif(CUDA, reason="a CUDA device is present: test_full_run_on_cuda covers it")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    result = run_check("--json", str(tmp_path / "out.json"), timeout_s=60)

    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    assert "no GPU present" in lines[0]
    assert "unmeasured" in lines[0]
    assert json.loads((tmp_path / "out.json").read_text())["cuda"] is False


def test_cpu_mode_runs_the_correctness_harness_and_the_pool_trace(tmp_path):
    out = tmp_path / "out.json"
    result = run_check("--cpu", "--json", str(out), timeout_s=240)

    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows = {row["check"]: row for row in report["rows"]}
    mlp = rows["mlp fp32 on cpu"]
    assert mlp["status"] == "PASS", mlp
    assert mlp["data"]["max_relative_error"] <= mlp["data"]["tolerance"] == 1e-4
    assert mlp["data"]["sizes"] == [1, 7, 64]
    assert mlp["data"]["requests"] == 12
    staged = rows["mlp fp32 buckets+staging on cpu"]
    assert staged["status"] == "PASS" and staged["data"]["input_staging"] == "queue"
    assert staged["data"]["buckets"] == [1, 2, 4, 8, 16, 32, 64]
    correctness = [row for row in report["rows"] if row["section"] == "a"]
    assert len(correctness) == 9
    assert all(row["status"] == "PASS" for row in correctness), correctness
    assert any(line.split()[:4] == ["mlp", "fp32", "on", "cpu"] and "PASS" in line
               for line in result.stdout.splitlines()), result.stdout
    # (b): every seeded trace served by our pool, its in-use / reserved figure printed.
    pool = rows["batchgate pool, mixed traces, on cpu"]
    assert pool["status"] == "INFO"
    assert all(seed["refused"] == 0 for seed in pool["data"]["seeds"])
    assert 0.5 < pool["data"]["min_ratio"] <= pool["data"]["ratio"] <= 1.0
    assert rows["caching allocator, same trace"]["status"] == "SKIP"
    # (b): the server's own trace ran its harness (ServedModels served at mixed batch sizes,
    # one unloaded and another loaded meanwhile, every answer checked); no device figure.
    trace = rows["server trace, per-model pools (harness only, on cpu)"]
    assert trace["status"] == "INFO", trace
    assert trace["data"]["correct"] is True and trace["data"]["requests"] > 0
    assert trace["data"]["loaded"] in trace["data"]["models"]
    assert trace["data"]["ratio_end"] is None
    assert {row["section"] for row in report["rows"]} == {"a", "b"}


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
def test_full_run_on_cuda(tmp_path):
    out = tmp_path / "out.json"
    result = run_check("--json", str(out), timeout_s=540)

    print(result.stdout[-12000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    correctness = [row for row in report["rows"] if row["section"] == "a"]
    assert len(correctness) == 18, correctness
    assert all(row["status"] == "PASS" for row in correctness), correctness
    rows = {row["check"]: row for row in report["rows"]}
    assert rows["server trace, per-model pools"]["data"]["correct"] is True
    assert rows["graph model loaded while another serves"]["status"] == "PASS"


@pytest.mark.slow
def test_cpu_mode_runs_the_gateway_throughput_harness(tmp_path):
    # Section (c)'s code (temporary repository, the harness's in-thread server, batchgate.bench.loadgen's
    # worker processes)
    # is the most involved part of the GPU run: prove it here, small, on the CPU.
    out = tmp_path / "out.json"
    result = run_check("--cpu", "--sections", "c", "--json", str(out), timeout_s=120)

    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["check"]: row for row in json.loads(out.read_text())["rows"]}
    gateway = rows["encoder gateway amp-bf16 c8"]
    assert gateway["status"] == "INFO", gateway
    assert gateway["data"]["errors"] == 0 and gateway["data"]["errors_by_status"] == {}
    assert gateway["data"]["requests_ok"] > 0
    assert gateway["data"]["ratio_vs_inprocess"] > 0
    assert rows["encoder in-process b8 amp-bf16+graphs"]["status"] == "SKIP"
