"""What the run was on: the machine, its packages, which parts of the project import here, and
the structlog stand-in for a machine without its wheel."""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import subprocess
import sys
from typing import Any

from batchgate.bench.gpu_check.report import Report, say, summary


PACKAGES = ("numpy", "grpcio", "protobuf", "structlog", "grpcio-health-checking",
            "grpcio-reflection", "prometheus-client", "torchvision", "nvidia-ml-py")


def package_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


def ensure_structlog() -> str:
    """Import structlog, or install a stand-in that logs through ``logging`` (said so)."""
    try:
        import structlog  # noqa: F401
    except ImportError:
        pass
    else:
        try:
            from batchgate.server.logs import configure_logging

            configure_logging("warning", "console")  # keep the server's info lines off the tail
        except Exception as exc:  # the check still runs with structlog's defaults
            return f"structlog set-up failed ({summary(exc)})"
        return ""
    import logging
    import types

    class StandInLogger:
        def __init__(self, name: str = "") -> None:
            self._log = logging.getLogger(name)

        def _emit(self, level: int, event: str, exc_info: Any = None, **fields: Any) -> None:
            self._log.log(level, "%s %s", event, fields, exc_info=exc_info)

        def debug(self, event: str, **fields: Any) -> None:
            self._emit(logging.DEBUG, event, **fields)

        def info(self, event: str, **fields: Any) -> None:
            self._emit(logging.INFO, event, **fields)

        def warning(self, event: str, **fields: Any) -> None:
            self._emit(logging.WARNING, event, **fields)

        def error(self, event: str, **fields: Any) -> None:
            self._emit(logging.ERROR, event, **fields)

        def exception(self, event: str, **fields: Any) -> None:
            fields.setdefault("exc_info", True)
            self._emit(logging.ERROR, event, **fields)

    stand_in = types.ModuleType("structlog")
    stand_in.get_logger = StandInLogger  # type: ignore[attr-defined]
    sys.modules["structlog"] = stand_in
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return "structlog missing: a stand-in logger is used (carry its wheel, see the docstring)"


def project_imports() -> dict[str, str]:
    """Which parts of the project import here: 'ok' or the error."""
    found = {}
    for module in ("batchgate.batcher.model", "batchgate.server.config.model_config",
                   "batchgate.server.frontend.app", "batchgate.clients"):
        try:
            importlib.import_module(module)
            found[module] = "ok"
        except Exception as exc:
            found[module] = summary(exc)
    return found


def machine_facts(device: str) -> dict[str, Any]:
    import torch

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "packages": package_versions(),
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpu=torch.cuda.get_device_name(0),
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            driver=driver_version(),
            cudnn=torch.backends.cudnn.version(),
            tf32=tf32_flags(),
        )
    return facts


def allocator_settings(configured: dict[str, str] | None) -> dict[str, Any]:
    """The allocator's settings as this process runs: both variables torch reads (None where
    unset), what ``gpu_env.configure()`` returned, and on a CUDA device what the allocator does
    (``allocator_in_force``)."""
    from batchgate.batcher.gpu_env import ALLOC_CONF_VARS

    settings: dict[str, Any] = {name: os.environ.get(name) for name in ALLOC_CONF_VARS}
    settings["configure"] = configured
    return settings


def allocator_in_force(device: str) -> dict[str, Any]:
    """Read back from the allocator after one allocation: its backend, and whether the segment
    it made is expandable (None: this torch's snapshot does not say)."""
    import torch

    found: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        found["backend"] = torch.cuda.get_allocator_backend()
    probe = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    address = probe.data_ptr()
    expandable = None
    for segment in torch.cuda.memory_snapshot():
        start = segment.get("address", 0)
        if start <= address < start + segment.get("total_size", 0):
            expandable = segment.get("is_expandable")
    found["expandable_segments"] = expandable
    del probe
    torch.cuda.empty_cache()  # the probe's segment would count as reserved in what follows
    return found


def describe_allocator(settings: dict[str, Any]) -> str:
    """One line: both variables as set, and what the allocator was seen doing."""
    from batchgate.batcher.gpu_env import ALLOC_CONF_VARS

    text = ", ".join(f"{name}={settings.get(name)!r}" if settings.get(name) is not None
                     else f"{name} unset" for name in ALLOC_CONF_VARS)
    if "expandable_segments" in settings:
        seen = settings["expandable_segments"]
        text += ("; in force: expandable segments "
                 + ("unknown (no is_expandable in the snapshot)" if seen is None
                    else "on" if seen else "off"))
        if settings.get("backend"):
            text += f", backend {settings['backend']}"
    return text


def tf32_flags() -> dict[str, bool | None]:
    """Whether fp32 matmuls / cuDNN convolutions may run in TF32 (None: could not tell)."""
    import warnings

    import torch

    flags: dict[str, bool | None] = {}
    for key, read in (("matmul", lambda: torch.backends.cuda.matmul.allow_tf32),
                      ("cudnn", lambda: torch.backends.cudnn.allow_tf32)):
        with warnings.catch_warnings(), contextlib.suppress(Exception):
            warnings.simplefilter("ignore")  # newer torch nudges towards fp32_precision
            flags[key] = bool(read())
        flags.setdefault(key, None)
    return flags


def driver_version() -> str:
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    with contextlib.suppress(Exception):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    return "unknown"


def print_machine(report: Report) -> None:
    m = report.machine
    say("machine: " + ", ".join(
        f"{key} {m[key]}" for key in ("gpu", "capability", "gpu_memory_gib", "driver", "torch",
                                      "torch_cuda", "cudnn", "python", "cpus") if key in m))
    if "tf32" in m:
        say(f"tf32 allowed: matmul {m['tf32']['matmul']}, cudnn {m['tf32']['cudnn']}")
    if "allocator" in m:
        say("allocator: " + describe_allocator(m["allocator"]))
    say("packages: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()))
    if m.get("structlog_note"):
        say(m["structlog_note"])
    say("imports: " + ", ".join(f"{k} {v}" for k, v in m.get("imports", {}).items()))


def torchvision_problem() -> str:
    """Why ResNet-50 cannot be built here ("" when torchvision imports)."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # a torchvision built for another torch fails here too
        return f"torchvision does not import ({summary(exc, 100)})"
    return ""

