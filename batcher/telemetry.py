"""GPU telemetry from NVML (``pynvml``, the ``nvidia-ml-py`` package), as Prometheus gauges.

``GpuTelemetry`` is a prometheus_client collector: each scrape of ``/metrics`` reads, per GPU,
the utilisation (the fraction of the last sample period in which a kernel ran), memory used and
total, and power draw. Reading at scrape time keeps the figures fresh without a thread, and
costs nothing while nobody scrapes. The process that serves ``/metrics`` registers it (the
server in one-process mode, the supervisor with ``--frontends``).

NVML sees every GPU of the machine and numbers them its own way; the server's pool metrics say
``cuda:N``, CUDA's numbering of the GPUs this process may use. So the collector exports only the
GPUs ``CUDA_VISIBLE_DEVICES`` lets the server use, labelled ``gpu="cuda:N"`` like the pools, with
the board's ``uuid``: entries given as UUIDs (``GPU-...``, or a unique prefix) are matched by
UUID; entries given as indices are NVML's indices, which is CUDA's numbering because every
serving process sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (``batcher/gpu_env.py``), NVML's order.
Like CUDA, the list stops at its first entry that names no GPU; MIG instances are not exported.

Without the package, the driver or a GPU the collector yields nothing: the metric families are
simply absent, and the reason is logged once at debug level (a CPU machine is not an error). A
figure a GPU does not support (power on some boards) is left out for that GPU only.

torch-free: the supervisor imports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
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

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._nvml: Any = None
        self._gpus: list[tuple[str, str, Any]] = []  # (cuda:N, UUID, handle)
        try:
            import pynvml
        except ImportError:
            log.debug("gpu_telemetry_absent", reason="pynvml (nvidia-ml-py) is not installed")
            return
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ... on a CPU box
            log.debug("gpu_telemetry_absent", reason=f"NVML unavailable: {exc}")
            return
        env = os.environ if environ is None else environ
        order = visible_order(env.get("CUDA_VISIBLE_DEVICES"), uuids)
        self._gpus = [(f"cuda:{n}", uuids[i], handles[i]) for n, i in enumerate(order)]
        self._nvml = pynvml
        log.info("gpu_telemetry", gpus=[(label, uuid) for label, uuid, _ in self._gpus])

    @property
    def gpus(self) -> int:
        return len(self._gpus)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if not self._gpus:
            return
        nvml = self._nvml
        families = {key: GaugeMetricFamily(name, documentation, labels=["gpu", "uuid"])
                    for key, name, documentation in FAMILIES}
        readers = {
            "utilization": lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
            "used": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used,
            "total": lambda h: nvml.nvmlDeviceGetMemoryInfo(h).total,
            "power": lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
        }
        for label, uuid, handle in self._gpus:
            for key, read in readers.items():
                try:
                    families[key].add_metric([label, uuid], read(handle))
                except Exception:  # NVMLError_NotSupported and kin: that figure only
                    continue
        yield from (family for family in families.values() if family.samples)


def visible_order(visible: str | None, uuids: Sequence[str]) -> list[int]:
    """NVML indices of the GPUs ``CUDA_VISIBLE_DEVICES`` makes ``cuda:0``, ``cuda:1``...
    (unset: all of them)."""
    if visible is None:
        return list(range(len(uuids)))
    order: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            index = int(entry)
            found = index if index < len(uuids) else None
        elif entry.startswith("GPU-"):
            matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
            found = matches[0] if len(matches) == 1 else None
        else:  # empty, MIG-..., anything else: CUDA stops here
            found = None
        if found is None or found in order:
            break
        order.append(found)
    return order


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
