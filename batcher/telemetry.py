"""GPU telemetry from NVML (``pynvml``, the ``nvidia-ml-py`` package), as Prometheus gauges.

``GpuTelemetry`` is a prometheus_client collector: each scrape of ``/metrics`` reads, per GPU,
the utilisation (the fraction of the last sample period in which a kernel ran), memory used and
total, and power draw. Reading at scrape time keeps the figures fresh without a thread, and
costs nothing while nobody scrapes. The process that serves ``/metrics`` registers it (the
server in one-process mode, the supervisor with ``--frontends``); NVML sees every GPU of the
machine, whichever process asks.

Without the package, the driver or a GPU the collector yields nothing: the metric families are
simply absent, and the reason is logged once at debug level (a CPU machine is not an error). A
figure a GPU does not support (power on some boards) is left out for that GPU only.

torch-free: the supervisor imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import structlog
from prometheus_client.core import GaugeMetricFamily

log = structlog.get_logger(__name__)

# What a scrape shows per GPU: (key, family name, help). Exported only where NVML answers.
FAMILIES = (
    ("utilization", "batchgate_gpu_utilization_ratio",
     "Fraction of NVML's last sample period in which a kernel ran on the GPU."),
    ("used", "batchgate_gpu_memory_used_bytes", "GPU memory in use (every process), from NVML."),
    ("total", "batchgate_gpu_memory_total_bytes", "GPU memory on the board, from NVML."),
    ("power", "batchgate_gpu_power_watts", "GPU power draw, from NVML."),
)


class GpuTelemetry:
    """NVML figures of every GPU, read on each collect."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._gpus: list[tuple[str, Any]] = []  # (NVML index, handle)
        try:
            import pynvml
        except ImportError:
            log.debug("gpu_telemetry_absent", reason="pynvml (nvidia-ml-py) is not installed")
            return
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._gpus = [(str(i), pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ... on a CPU box
            log.debug("gpu_telemetry_absent", reason=f"NVML unavailable: {exc}")
            return
        self._nvml = pynvml
        log.info("gpu_telemetry", gpus=len(self._gpus))

    @property
    def gpus(self) -> int:
        return len(self._gpus)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if not self._gpus:
            return
        nvml = self._nvml
        families = {key: GaugeMetricFamily(name, documentation, labels=["gpu"])
                    for key, name, documentation in FAMILIES}
        readers = {
            "utilization": lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
            "used": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used,
            "total": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).total,
            "power": lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
        }
        for index, handle in self._gpus:
            for key, read in readers.items():
                try:
                    families[key].add_metric([index], read(handle))
                except Exception:  # NVMLError_NotSupported and kin: that figure only
                    continue
        yield from (family for family in families.values() if family.samples)
