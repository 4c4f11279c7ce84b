"""(e) GPU busy %: NVML utilisation sampled on a thread while a load runs."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from batchgate.bench.gpu_check.report import summary

NVML_INTERVAL_S = 0.1


class NvmlSampler:
    """GPU utilisation (NVML, % of time a kernel ran) every ``NVML_INTERVAL_S`` on a thread."""

    def __init__(self) -> None:
        self.unavailable = ""
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml
        except ImportError as exc:
            self.unavailable = f"pynvml (nvidia-ml-py) does not import: {summary(exc)}"
            return
        try:
            pynvml.nvmlInit()
            self._handle = self._device_handle(pynvml)
        except Exception as exc:
            self.unavailable = f"NVML unavailable: {summary(exc)}"
            return
        self._nvml = pynvml

    @staticmethod
    def _device_handle(pynvml: Any) -> Any:
        # cuda:0 is not NVML's device 0 when CUDA_VISIBLE_DEVICES reorders: match by UUID.
        with contextlib.suppress(Exception):
            import torch

            uuid = str(torch.cuda.get_device_properties(0).uuid)
            for candidate in (uuid, f"GPU-{uuid}"):
                with contextlib.suppress(Exception):
                    return pynvml.nvmlDeviceGetHandleByUUID(candidate)
        return pynvml.nvmlDeviceGetHandleByIndex(0)

    def __enter__(self) -> NvmlSampler:
        self._stop.clear()
        if not self.unavailable:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(NVML_INTERVAL_S):
            with contextlib.suppress(Exception):
                rates = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
                self.samples.append((time.monotonic(), int(rates.gpu)))

    def between(self, start: float, stop: float) -> list[int]:
        return [u for t, u in self.samples if start <= t <= stop]


def busy_summary(values: list[int]) -> tuple[str, dict[str, Any]]:
    if not values:
        return "no samples", {"samples": 0}
    mean = sum(values) / len(values)
    return (f"mean {mean:.0f} %, min {min(values)} % ({len(values)} samples)",
            {"mean_pct": mean, "min_pct": min(values), "samples": len(values)})


