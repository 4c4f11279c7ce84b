"""What is per device in a serving process, in one object per device.

A ``Device`` holds what the models placed on one device share: the device memory pools their
memory plans and staged inputs are carved from (``batcher/memory.py``: one arena per model,
reserved at its admission, under the device's cap) and the weighted turns of those that set
``device_share_weight`` (``batcher/device_share.py``). Each model's own allocator pools,
streams and CUDA graphs are the model's (``batcher/gpu.py``, ``batcher/graphs.py``): nothing
of them is shared.

``Devices``: a process's devices, each made on first use. The model repository makes one and
hands it to every model it loads; a model built alone (tests, benchmarks) makes its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from batchgate.batcher.device_share import DeviceShare
from batchgate.batcher.memory import DevicePools
from batchgate.batcher.pool import DevicePool


class Device:
    """One device's shared state (see the module docstring)."""

    def __init__(self, name: str, pools: DevicePools | None) -> None:
        self.name = name
        self._pools = pools
        self.share = DeviceShare(name)

    @property
    def pooled(self) -> bool:
        """Whether the models are served from pools (else their buffers are plain tensors)."""
        return self._pools is not None

    def reserve(self, owner: str, sizes: Iterable[int], what: str) -> DevicePool | None:
        """``owner``'s arena for allocations of ``sizes`` bytes, reserved now (raises
        ResourceExhausted when it does not fit); None when served without pools."""
        if self._pools is None:
            return None
        return self._pools.reserve(self.name, owner, sizes, what)

    def release(self, owner: str, pool: DevicePool) -> None:
        """Give ``owner``'s arena back."""
        if self._pools is not None:
            self._pools.release(owner, pool)

    def refresh(self, pool: DevicePool) -> None:
        """Set the pool's gauges (after an admission, a release or a batch)."""
        if self._pools is not None:
            self._pools.refresh(pool)


class Devices:
    """A process's devices by name ("cpu", "cuda:0", ...), made on first use."""

    def __init__(self, pools: DevicePools | None = None) -> None:
        self.pools = pools
        self._devices: dict[str, Device] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Device:
        key = str(torch.device(name))
        with self._lock:
            device = self._devices.get(key)
            if device is None:
                device = self._devices[key] = Device(key, self.pools)
            return device
