"""The process settings every process that serves on a GPU takes before CUDA initialises.

torch's CUDA caching allocator reads its configuration once, when CUDA first initialises in the
process, and CUDA numbers the devices once too. ``configure()`` runs first thing in each entry
point that may serve on a GPU (``batchgate`` in single-process mode and as the supervisor, the
executor process), before anything touches CUDA:

- ``PYTORCH_ALLOC_CONF=expandable_segments:True``, unless the operator set it (or its older
  name ``PYTORCH_CUDA_ALLOC_CONF``, which is then left as it is): segments that grow in place instead of
  new fixed-size segments per size, so batch-size churn inside a model's pool
  (``batcher/gpu.py``) maps and unmaps pages rather than stranding half-used segments. A plain
  ``torch.cuda.MemPool`` (no custom allocator) gets expandable segments too;
- ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, unless set: CUDA then numbers devices in NVML's order, so
  ``cuda:N`` and the GPU telemetry (``batcher/telemetry.py``) name the same board.

Children inherit the environment, so the supervisor's call covers the executor process it starts;
the executor calls it again (harmless) for when it is started on its own.

torch-free: the supervisor imports it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

ALLOC_CONF = "expandable_segments:True"
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def configure(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the allocator configuration and the device order where the operator did not; return
    what is in force. Raises RuntimeError when CUDA is already initialised in this process (the
    settings would not apply)."""
    env = os.environ if environ is None else environ
    torch = sys.modules.get("torch")
    if environ is None and torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before batchgate.batcher.gpu_env.configure(): the "
                           "allocator configuration must be set before the first CUDA call")
    given = next((env[name] for name in ALLOC_CONF_VARS if env.get(name)), None)
    conf = given if given is not None else ALLOC_CONF
    if given is None:
        env[ALLOC_CONF_VARS[0]] = conf
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return {"alloc_conf": conf, "device_order": env["CUDA_DEVICE_ORDER"]}
