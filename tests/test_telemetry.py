"""NVML telemetry: absent without a GPU (no families, no error), present and sane with one.

Real NVML cannot run on a machine without a GPU driver, so the test of how figures become
metric families uses a stand-in ``pynvml`` module with NVML's call names; the real library is
checked by the CUDA-marked test.
"""

from __future__ import annotations

import sys
import types
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchgate.batcher.telemetry import GpuTelemetry
from batchgate.bench.harness.server import ServeProcess
from tests.support import EXAMPLE_MODELS

CUDA = torch.cuda.is_available()
GPU_FAMILIES = ("batchgate_gpu_utilization_ratio", "batchgate_gpu_memory_used_bytes",
                "batchgate_gpu_memory_total_bytes", "batchgate_gpu_power_watts")


def families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


@pytest.mark.skipif(CUDA, reason="a GPU is present: test_nvml_figures_on_a_gpu covers it")
@pytest.mark.parametrize("mode", ["single", "native"])
def test_without_a_gpu_the_families_are_absent_and_nothing_is_logged_as_an_error(
        tmp_path, mode):
    import shutil

    from tests.support.servers import native_or_skip

    if mode == "native":
        native_or_skip()

    shutil.copytree(EXAMPLE_MODELS / "cnn", tmp_path / "cnn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    server = ServeProcess("serve", "--frontend", mode, "--host", "127.0.0.1",
                          "--grpc-port", "0", "--metrics-port", "0", "--model-repository",
                          str(tmp_path), *([] if mode == "single" else
                                           ["--arena-bytes", str(64 << 20)]),
                          "--log-format", "json",
                          "--log-level", "debug", "--no-gc-freeze")
    try:
        serving = server.wait_for("serving")
        # One process says its port when it starts listening; the supervisor when serving.
        port = serving.get("metrics_port") or server.wait_for("listening")["metrics_port"]
        url = f"http://127.0.0.1:{port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        found = families(text)
        assert "batchgate_pool_bytes_in_use" in found  # a real scrape of the whole server
        assert not [name for name in found if name.startswith("batchgate_gpu_")]
    finally:
        assert server.stop() == 0
    absent = [e for e in server.events if e.get("event") == "gpu_telemetry_absent"]
    assert absent and all(e["level"] == "debug" for e in absent), absent
    loud = [e for e in server.events if e.get("level") in ("error", "critical")]
    assert not loud, loud


class StandInNvml(types.ModuleType):
    """NVML's Python calls, answering for two GPUs; the second has no power sensor."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return [b"GPU-aaaa-0000", b"GPU-bbbb-1111"][handle]

    def nvmlDeviceGetUtilizationRates(self, handle: int):
        return types.SimpleNamespace(gpu=[97, 12][handle], memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        return types.SimpleNamespace(used=(handle + 1) * 2**30, total=141 * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle == 1:
            raise self.NVMLError("Not Supported")
        return 612_500  # milliwatts


def test_nvml_figures_become_gauges_per_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", StandInNvml())
    registry = CollectorRegistry()
    registry.register(GpuTelemetry(environ={}))
    found = families(generate_latest(registry).decode())
    values = {name: {s.labels["gpu"]: s.value for s in found[name]} for name in GPU_FAMILIES}
    assert values["batchgate_gpu_utilization_ratio"] == {"cuda:0": 0.97, "cuda:1": 0.12}
    assert values["batchgate_gpu_memory_used_bytes"] == {"cuda:0": 2**30, "cuda:1": 2 * 2**30}
    assert values["batchgate_gpu_memory_total_bytes"] == {"cuda:0": 141 * 2**30,
                                                          "cuda:1": 141 * 2**30}
    assert values["batchgate_gpu_power_watts"] == {"cuda:0": 612.5}  # GPU 1 has no sensor
    uuids = {s.labels["gpu"]: s.labels["uuid"]
             for s in found["batchgate_gpu_utilization_ratio"]}
    assert uuids == {"cuda:0": "GPU-aaaa-0000", "cuda:1": "GPU-bbbb-1111"}


@pytest.mark.parametrize(("visible", "exported"), [
    ("1", {"cuda:0": "GPU-bbbb-1111"}),  # the pools' cuda:0 is NVML's GPU 1
    ("GPU-bbbb,GPU-aaaa-0000", {"cuda:0": "GPU-bbbb-1111", "cuda:1": "GPU-aaaa-0000"}),
    ("0,7,1", {"cuda:0": "GPU-aaaa-0000"}),  # CUDA stops at the first entry naming no GPU
    ("", {}),
])
def test_only_the_visible_gpus_are_exported_under_their_cuda_names(monkeypatch, visible,
                                                                   exported):
    monkeypatch.setitem(sys.modules, "pynvml", StandInNvml())
    registry = CollectorRegistry()
    registry.register(GpuTelemetry(environ={"CUDA_VISIBLE_DEVICES": visible}))
    found = families(generate_latest(registry).decode())
    samples = found.get("batchgate_gpu_utilization_ratio", [])
    assert {s.labels["gpu"]: s.labels["uuid"] for s in samples} == exported


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device; this machine has none")
def test_nvml_figures_on_a_gpu():
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed")
    telemetry = GpuTelemetry()
    assert telemetry.gpus >= 1
    registry = CollectorRegistry()
    registry.register(telemetry)
    found = families(generate_latest(registry).decode())
    used = found["batchgate_gpu_memory_used_bytes"][0].value
    total = found["batchgate_gpu_memory_total_bytes"][0].value
    assert 0 < used <= total
    assert 0.0 <= found["batchgate_gpu_utilization_ratio"][0].value <= 1.0


def test_observe_all_counts_as_observe_does():
    """A batch's amounts written at once (one update per bucket) read back, through the
    Prometheus text, exactly as one observe per amount does: bounds, below and above them.
    It reads the Histogram's own buckets, so this also catches a prometheus_client that
    changed them."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from batchgate.batcher.metrics import SECONDS_BUCKETS, observe_all

    amounts = [0.0, *SECONDS_BUCKETS[:6], *(b * 1.5 for b in SECONDS_BUCKETS[:6]), 1e6, 3e-7]
    samples = []
    for write in ("one by one", "at once"):
        registry = CollectorRegistry()
        histogram = Histogram("h_seconds", "h", ["model"], registry=registry,
                              buckets=SECONDS_BUCKETS)
        child = histogram.labels(model="m")
        if write == "at once":
            observe_all(child, amounts)
        else:
            for amount in amounts:
                child.observe(amount)
        samples.append({(s.name, tuple(sorted(s.labels.items()))): s.value
                        for family in text_string_to_metric_families(
                            generate_latest(registry).decode())
                        for s in family.samples if not s.name.endswith("_created")})
    assert samples[0] == samples[1]
    assert samples[1][("h_seconds_count", (("model", "m"),))] == len(amounts)
