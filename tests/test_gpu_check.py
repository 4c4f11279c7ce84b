"""`python -m batchgate.bench.gpu_check` as it is run: a real process, without a GPU here, on one
where there is one; from an installed checkout and from a bare one; and `scripts/gpu-check.sh`,
the one command a GPU machine runs, on the CPU path."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
TARGETS = 7  # the GPU targets, one row each (bench/gpu_check/targets.py)


def check_env(**extra: str) -> dict[str, str]:
    """This environment without the allocator's settings (the check sets its own)."""
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_VARS}
    env.update(extra)
    return env


def run_check(*args: str, timeout_s: float, bare: bool = False,
              root: Path = ROOT) -> subprocess.CompletedProcess:
    """The check as a process from the repository root (``root``: another checkout's); ``bare``:
    as a checkout that is not installed (site-packages on the path without their .pth files, so
    no editable finder)."""
    python = [sys.executable]
    env = check_env()
    if bare:
        python.append("-S")
        env["PYTHONPATH"] = os.pathsep.join(
            dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    return subprocess.run([*python, "-m", "batchgate.bench.gpu_check", *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.skipif(CUDA, reason="a CUDA device is present: test_full_run_on_cuda covers it")
@pytest.mark.parametrize("bare", [False, True], ids=["installed", "bare-checkout"])
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, bare):
    result = run_check("--json", str(tmp_path / "out.json"), timeout_s=60, bare=bare)

    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    assert "no GPU present" in lines[0]
    assert "unmeasured" in lines[0]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["cuda"] is False
    # Every target is named as unmeasured, with why.
    assert len(report["unmeasured"]) == TARGETS
    assert all("no GPU present" in why for why in report["unmeasured"].values())


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
    # configure() ran before anything else, and the settings are printed as they are.
    assert report["machine"]["allocator"]["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert report["machine"]["allocator"]["PYTORCH_CUDA_ALLOC_CONF"] is None
    assert ("allocator: PYTORCH_ALLOC_CONF='expandable_segments:True', "
            "PYTORCH_CUDA_ALLOC_CONF unset") in result.stdout
    # (b): every seeded trace through arenas reserved from each model's limits, as the server
    # reserves a plan, never from the trace's own peak.
    arenas = rows["batchgate arenas, mixed traces, on cpu"]
    assert arenas["status"] == "INFO"
    for seed in arenas["data"]["seeds"]:
        assert seed["bytes_reserved"] == limits_plan_bytes(seed["seed"], seed["steps"])
        assert seed["peak_live_bytes"] <= seed["peak_bytes_in_use"] < seed["bytes_reserved"]
    assert 0 < arenas["data"]["min_ratio"] <= arenas["data"]["ratio"] < 1.0
    assert arenas["data"]["refused"] == sum(s["refused"] for s in arenas["data"]["seeds"])
    assert f"{arenas['data']['refused']} of 32000 allocations refused" in arenas["result"]
    assert rows["caching allocator, same traces"]["status"] == "SKIP"
    # (b): the server's own trace ran its harness (two instances of two batches in flight per
    # model, clients at mixed batch sizes, one model unloaded and another loaded meanwhile,
    # every answer checked); no device figure.
    trace = rows["server trace, per-model pools (harness only, on cpu)"]
    assert trace["status"] == "INFO", trace
    assert trace["data"]["correct"] is True and trace["data"]["requests"] > 0
    assert trace["data"]["loaded"] in trace["data"]["models"]
    assert trace["data"]["ratio_mean"] is None and "unmeasured" in trace["result"]
    concurrent = rows["concurrent load, per-model pools (on cpu)"]
    assert concurrent["status"] == "PASS", concurrent
    assert concurrent["data"]["failed"] == concurrent["data"]["wrong"] == 0
    assert concurrent["data"]["instances"] == concurrent["data"]["inflight_batches"] == 2
    assert {row["section"] for row in report["rows"]} == {"a", "b", "targets"}
    assert_every_target_unmeasured(report, "needs a CUDA device")


def limits_plan_bytes(seed: int, steps: int) -> int:
    """What the server would reserve for mixed_trace(seed)'s models, worked out here: per
    model, 2 inputs and 6 outputs at its largest, each aligned, plus one alignment."""
    from batchgate.batcher.pool import DEFAULT_POOL_ALIGNMENT as align
    from batchgate.batcher.allocation_trace import mixed_trace

    largest: dict[tuple[str, str], int] = {}
    for event in mixed_trace(seed, steps=steps):
        if event[0] == "alloc":
            model, _, kind = event[1].split(".")
            largest[model, kind] = max(largest.get((model, kind), 0), event[2])
    aligned = {key: -(-n // align) * align for key, n in largest.items()}
    models = {model for model, _ in largest}
    return sum(2 * aligned[m, "in"] + 6 * aligned[m, "out"] + align for m in models)


def assert_every_target_unmeasured(report: dict, why: str) -> None:
    targets = [row for row in report["rows"] if row["section"] == "targets"]
    assert len(targets) == TARGETS, targets
    assert all(row["status"] == "UNMEASURED" and why in row["result"] for row in targets), \
        targets


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
    assert rows["graph model loaded while others serve"]["status"] == "PASS"
    # Every target has its row; none is MET without its figure.
    targets = [row for row in report["rows"] if row["section"] == "targets"]
    assert len(targets) == TARGETS, targets
    assert all(row["status"] in ("MET", "NOT MET", "UNMEASURED") for row in targets), targets


@pytest.mark.slow
def test_cpu_mode_runs_the_gateway_throughput_harness(tmp_path):
    # Section (c)'s code (temporary repository, the harness's in-thread server,
    # batchgate.bench.loadgen's worker processes) is the most involved part of the GPU run:
    # prove it here, small, on the CPU.
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


@pytest.mark.slow
def test_a_checkout_without_its_test_tree_runs_the_gateway_harness(tmp_path):
    # A GPU machine may get the package's folders and no tests/: section (c) still starts the
    # shared harness's server, and the pytest section says why it has nothing to run.
    from batchgate._checkout import EXAMPLE_MODELS, FOLDERS

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy2(ROOT / "setup.py", checkout / "setup.py")
    for folder in ("batchgate", *FOLDERS, EXAMPLE_MODELS):
        shutil.copytree(ROOT / folder, checkout / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "out.json"
    result = run_check("--cpu", "--sections", "c", "--pytest", "--json", str(out),
                       timeout_s=150, bare=True, root=checkout)

    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row["check"]: row for row in json.loads(out.read_text())["rows"]}
    gateway = rows["encoder gateway amp-bf16 c8"]
    assert gateway["status"] == "INFO" and gateway["data"]["requests_ok"] > 0, gateway
    assert rows["pytest -m cuda"]["status"] == "SKIP"
    assert "no test tree" in rows["pytest -m cuda"]["result"], rows["pytest -m cuda"]


# --- scripts/gpu-check.sh: the one command a GPU machine runs ---------------------------------

SCRIPT = ROOT / "scripts" / "gpu-check.sh"
REQUIREMENTS = ROOT / "scripts" / "gpu-check-requirements.txt"
WHEELS = ROOT / ".whl"


def install_wheels():
    spec = importlib.util.spec_from_file_location("install_wheels",
                                                  ROOT / "scripts" / "install_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wheels_missing() -> str | None:
    """Why the script cannot install here (None: every pin has its wheel in .whl/)."""
    tool = install_wheels()
    missing = [f"{n}=={v}" for n, v, _ in tool.read_pins(REQUIREMENTS)
               if tool.wheel_for(WHEELS, n, v) is None]
    if missing:
        return (f".whl/ lacks {len(missing)} wheels of scripts/gpu-check-requirements.txt for "
                f"this Python (scripts/gpu-check-wheels.sh downloads them): {missing[:3]}")
    return None


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="a CUDA device is present: the script would run every section")
@pytest.mark.skipif(wheels_missing() is not None, reason=str(wheels_missing()))
def test_the_script_runs_the_check_on_the_cpu_from_its_private_wheels(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "--cpu", str(out)], cwd=tmp_path,
                          env=check_env(PYTHON=sys.executable, TMPDIR=str(tmp_path)),
                          capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # Every pin came from .whl/ into the private folder, which serves the check first: this
    # suite's own grpcio may be another version, the check's is the pinned one.
    tool = install_wheels()
    pins = {name: version for name, version, _ in tool.read_pins(REQUIREMENTS)}
    for name, version in pins.items():
        assert f"  {name} {version}: " in done.stdout or f"  {name}: " in done.stdout, name
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["machine"]["packages"]["grpcio"] == pins["grpcio"]
    assert report["machine"]["packages"]["protobuf"] == pins["protobuf"]
    assert all(state == "ok" for state in report["machine"]["imports"].values()), report
    # The table is the output's end, and pytest -m cuda ran from the same folder and skipped.
    text = (out / "gpu_check.txt").read_text()
    assert text.rstrip().splitlines()[-1].startswith("gpu_check: ") and "exit 0" in text
    rows = {row["check"]: row for row in report["rows"]}
    pytest_row = rows["pytest -m cuda"]
    assert pytest_row["status"] == "SKIP" and "skipped" in pytest_row["result"], pytest_row
    assert pytest_row["data"]["returncode"] == 0
    assert_every_target_unmeasured(report, "needs a CUDA device")
    # Nothing is left behind but what OUTDIR holds.
    assert not list(tmp_path.glob("batchgate-gpu-check.*"))


def test_the_script_says_which_wheels_it_lacks(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    done = subprocess.run(["bash", str(SCRIPT), "--cpu", str(tmp_path / "out")],
                          env=check_env(PYTHON=sys.executable, GPU_CHECK_WHEELS=str(empty),
                                        TMPDIR=str(tmp_path)),
                          capture_output=True, text=True, timeout=120)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "no wheel in" in done.stderr and "grpcio==" in done.stderr, done.stderr
    assert "scripts/gpu-check-wheels.sh" in done.stderr
    assert not (tmp_path / "out" / "gpu_check.json").exists()
    assert not list(tmp_path.glob("batchgate-gpu-check.*"))  # its private folder is removed


def test_the_script_without_an_outdir_prints_its_usage():
    done = subprocess.run(["bash", str(SCRIPT), "--cpu"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2
    assert "scripts/gpu-check.sh OUTDIR" in done.stderr


def test_wheels_are_chosen_by_this_interpreters_tags():
    tool = install_wheels()
    py312 = ((3, 12), "x86_64", (2, 36))
    assert tool.runs_here("cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64", py312)
    assert not tool.runs_here("cp311-cp311-manylinux2014_x86_64", py312)
    assert tool.runs_here("cp39-abi3-manylinux2014_x86_64", py312)  # protobuf's
    assert tool.runs_here("py3-none-any", py312)
    assert tool.runs_here("py2.py3-none-any", py312)
    assert not tool.runs_here("cp312-cp312-manylinux_2_28_aarch64", py312)
    old_glibc = ((3, 12), "x86_64", (2, 17))
    assert not tool.runs_here("cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64",
                              old_glibc)
    assert tool.runs_here("cp312-cp312-manylinux2014_x86_64", old_glibc)


def test_the_requirements_are_pins_and_every_import_of_the_check_is_among_them(tmp_path):
    tool = install_wheels()
    pins = tool.read_pins(REQUIREMENTS)
    names = {tool.normalized(name) for name, _, _ in pins}
    # What the device lacks (pyproject's server dependencies but torch, and pytest's).
    for needed in ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf",
                   "structlog", "prometheus-client", "pytest", "pytest-asyncio", "hypothesis"):
        assert tool.normalized(needed) in names, needed
    assert {name for name, _, absent in pins if absent} == {"numpy", "typing-extensions"}
    bad = tmp_path / "bad.txt"
    bad.write_text("grpcio>=1.81\n")
    with pytest.raises(SystemExit, match="name==version"):
        tool.read_pins(bad)


# --- the pieces that only a GPU exercises, checked on their CPU side ---------------------------


class StampEvent:
    """A stand-in for a timing CUDA event: its time on the device's clock, in ms."""

    def __init__(self, at_ms: float) -> None:
        self.at_ms = at_ms

    def elapsed_time(self, end: StampEvent) -> float:
        return end.at_ms - self.at_ms


def test_copy_stream_figures_split_the_copy_from_what_the_compute_waited_for():
    from batchgate.bench.gpu_check.copy_events import CopyStreamProbe

    probe = CopyStreamProbe([])
    e = StampEvent
    # Batch 1: copy 0-1, forward 1-11 (nothing before it: all of the copy is exposed).
    # Batch 2: copy 2-3 while batch 1 computes, forward 11-21: none exposed.
    # Batch 3: copy 20-23, forward 23-33: batch 2 ended at 21, so 2 ms were waited for.
    probe.batches = [(e(0), e(1), e(1), e(11)), (e(2), e(3), e(11), e(21)),
                     (e(20), e(23), e(23), e(33))]
    figures = probe.figures()
    assert figures["batches"] == 3
    assert figures["copy_ms"] == 1.0 and figures["forward_ms"] == 10.0
    assert figures["share"] == pytest.approx(1 / 11)
    assert figures["exposed_ms"] == 1.0  # the median of 1, 0 and 2
    assert CopyStreamProbe([]).figures() == {"batches": 0}


def test_the_copy_stream_probe_says_when_the_executor_has_no_copy_stream():
    from batchgate.batcher.model import ServedModel
    from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
    from batchgate.bench.gpu_check.copy_events import CopyStreamProbe, ProbeUnavailable

    spec = ModelSpec(name="m", version="1", platform="test", device="cpu",
                     inputs=(TensorSpec("x", "FP32", (4,)),),
                     outputs=(TensorSpec("y", "FP32", (4,)),),
                     batching=BatchingConfig(max_batch_size=4))
    served = ServedModel(spec, torch.nn.Identity())
    served.start()
    try:
        with pytest.raises(ProbeUnavailable, match="_copy_stream"):
            CopyStreamProbe(served._executors)  # on the CPU there is none
    finally:
        served.stop(5.0)


def test_targets_are_met_only_by_a_measured_figure():
    from batchgate.bench.gpu_check.report import INFO, PASS, Report
    from batchgate.bench.gpu_check.targets import evaluate

    report = Report()
    report.add("a", "mlp fp32 on cuda:0", "within", PASS)
    report.add("b", "concurrent load, per-model pools", "...", PASS, target="concurrent",
               requests=500, failed=0, wrong=0, errors={}, problems=[], instances=2,
               inflight_batches=2)
    report.add("b", "per-model pools vs PyTorch, while serving", "...", INFO, target="memory",
               pools=0.85, default=0.7, others={"PyTorch default": 0.7})
    report.unmeasured("amp", "ResNet-50 skipped: torchvision does not import")
    evaluate(report, "cuda:0", set("abcd"))

    verdicts = {row.data["target"]: row for row in report.rows if row.section == "targets"}
    assert len(verdicts) == TARGETS
    assert verdicts["correct"].status == "MET"
    assert verdicts["concurrent"].status == "MET"
    assert verdicts["memory"].status == "NOT MET" and "85.0%" in verdicts["memory"].result
    assert verdicts["amp"].status == "UNMEASURED"
    assert "torchvision does not import" in verdicts["amp"].result
    assert verdicts["busy"].status == "UNMEASURED" and "--sections" in verdicts["busy"].result
    # Section (d) ran but gave no figure: said so, not passed.
    assert verdicts["h2d"].status == "UNMEASURED"
    assert "no row measured it" in verdicts["h2d"].result


def test_a_server_trace_that_dies_while_serving_fails_the_concurrent_target(monkeypatch):
    # An abort inside the allocator (a MemPool released while a thread records into it) kills
    # the process: that is the concurrent load failing, not a figure left unmeasured.
    from batchgate.bench.gpu_check import memory
    from batchgate.bench.gpu_check.report import Budget, Report
    from batchgate.bench.gpu_check.targets import evaluate

    monkeypatch.setattr(memory, "gpu_check_command", lambda *flags: [
        sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGABRT)"])
    report = Report()
    memory.server_trace_rows(report, Budget(report, 60), "cuda:0")
    evaluate(report, "cuda:0", {"b"})

    verdicts = {row.data["target"]: row for row in report.rows if row.section == "targets"}
    assert verdicts["concurrent"].status == "NOT MET"
    assert "signal 6" in verdicts["concurrent"].result
    assert verdicts["memory"].status == "UNMEASURED"
    assert "did not give" in verdicts["memory"].result
