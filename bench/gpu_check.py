"""The GPU check: every GPU path of batchgate measured in one run of a few minutes.

Without a CUDA device it prints one line saying so and exits 0: nothing is pretended. With one,
it runs five sections, each in its own try/except and time budget, prints one table at the end
(the device machine returns only the tail of stdout) and, with ``--json FILE``, writes every
figure there too:

(a) correctness of every GPU path: the example models (mlp, cnn, encoder) served through
    ``ServedModel.infer`` on ``cuda:0``, admitted into a device memory pool, in each of
    ``GPU_VARIANTS``: fp32, amp-fp16, amp-bf16, fp16-weights (on a GPU a model's defaults are
    batch buckets ``pow2`` and ``input_staging`` queue, so these run the padded, staged path),
    amp-fp16 with CUDA graphs (the row fails if the graphs were not captured) and fp32 staged
    when the batch closes. Requests of 1, 7 and max_batch_size rows are sent together so that
    batches really form, and compared with the same module on the CPU in fp32. Error is
    max |out - ref| / max |ref| over every output of every request; a non-finite output fails.
    Tolerances (``TOLERANCES``): fp32 1e-4 (``TF32_TOLERANCE``, 2e-3, for a model with
    convolutions while ``torch.backends.cudnn.allow_tf32`` is on, torch's default, and for
    every model if matmuls may use TF32: TF32's 10-bit mantissa puts the max error near 5e-4),
    fp16 2e-2 (autocast and weights), bf16 5e-2 (8-bit mantissa).
(b) memory. First ``batcher.pool.mixed_trace`` (several models, random batch sizes, interleaved
    lifetimes; ``POOL_TRACE_SEEDS``): a synthetic trace of inputs and outputs through our
    device pool alone, each trace in the smallest arena that serves it, and through PyTorch's
    caching allocator (``torch.empty`` per allocation) in a subprocess per allocator setting.
    Then what the server itself allocates (``server_trace_main``, a subprocess per row of
    ``SERVER_TRACE_MODES``: per-model pools, PyTorch's default allocator, expandable_segments
    alone): ServedModels of several sizes serving requests of random batch sizes concurrently,
    one unloaded and another loaded while the rest serve; device-wide bytes in use / reserved
    sampled after every round (target: >= 90 % with pools, and above PyTorch's figures). With
    pools, a CUDA-graph model is loaded while the others serve and its answers are checked.
(c) throughput: the example encoder, a bigger encoder (d_model 512, 6 layers, sequence 128) and
    ResNet-50 (if torchvision imports; random weights), fp32, amp-fp16 and amp-fp16 replayed as
    one CUDA graph in a tight in-process loop at batch ``THROUGHPUT_BATCH``, then amp-fp16
    eager and amp-fp16 with CUDA graphs per bucket through the whole gateway (in-process
    ``Gateway`` on port 0, a temporary model repository, the SDK's AsyncClient from
    ``LOAD_PROCESSES`` processes at ``LOAD_CONCURRENCY`` requests in flight in all, one sample
    per request): gateway samples/s / in-process samples/s of the same path.
(d) host-to-device time on the critical path, for an mlp batch of 64 and a cnn batch of 32,
    timed with CUDA events against the forward: the batch's copy after it closes from pageable
    memory (a one-process server's request bytes) and from pinned memory (the shared arena),
    and what staging leaves there, the device-to-device gather of rows staged while queued:
    copy / (copy + forward). Then the gather as the executor really does it
    (``section_gather``): GATHER_REQUESTS single-sample requests of a ResNet-sized input per
    batch, staged at batch and while queued, assembly time against a ResNet-50 forward (target
    <= 5 %); and the shared arena pinned as the executor process pins it, with its cost.
(e) GPU busy %: NVML utilisation sampled every 100 ms while the gateway runs (c)'s load.
(t) ``pytest -m cuda`` on the same machine, in the same call (``--no-pytest`` leaves it out).

Exit status: 0; 1 when a correctness check of (a) failed or could not run; 3 when the run hit
``HARD_LIMIT_S`` (the table so far is printed first).

``--cpu`` runs section (a) on the CPU (fp32, amp-bf16, and the bucketed, staged path), (b)'s
synthetic traces through our pool and one run of the server trace's harness (its device figures
are unmeasured there), so the harness itself is tested on machines without a GPU; ``--cpu
--sections c`` also exercises (c)'s gateway harness there.

On the device machine (python 3.12 image with torch, torchvision and nvidia-ml-py, but without
structlog, grpcio-health-checking or grpcio-reflection, and with grpcio/protobuf of unknown
versions) carry the server's packages as wheels. Here, in the repository root (``.whl/`` is
in .gitignore, so it travels only when carried)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl structlog==26.1.0 grpcio==1.81.1 \
        grpcio-health-checking==1.81.1 grpcio-reflection==1.81.1 protobuf==6.33.6 \
        pytest==9.2.0 pytest-asyncio==1.5.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 \
        Pygments==2.21.0

and run, with ``carry: [".whl"]``::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --json $OUT/gpu_check.json

Without structlog a stand-in logger is used (and said so): (b)'s synthetic trace needs torch
alone, (a), (b)'s server trace and (d) need protobuf >= 6.33 too (the generated config module),
(c) every package above but pytest's, (t) pytest's too. The script uses only torch API that
torch 2.11 (the GPU machines') and 2.13 (CI) both have.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import importlib.util
import itertools
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file (``python bench/gpu_check.py``), not installed
    sys.path.insert(0, str(ROOT))

# -- time budgets (seconds): the whole run must stay well under 8 minutes ----------------------
HARD_LIMIT_S = 465.0  # the watchdog prints the table so far and exits 3
SOFT_LIMIT_S = 400.0  # no section starts after this
A_BUDGET_S = 70.0
D_BUDGET_S = 40.0
B_BUDGET_S = 125.0
B_SUBPROCESS_TIMEOUT_S = 40.0
C_BUDGET_S = 110.0
T_BUDGET_S = 90.0  # pytest -m cuda

# -- (a) correctness -----------------------------------------------------------------------------
EXAMPLE_MODELS = ("mlp", "cnn", "encoder")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One GPU path of (a): a precision and the ModelSpec fields that select the path."""

    label: str
    precision: str
    fields: tuple[tuple[str, Any], ...] = ()


# On a GPU a model's defaults are buckets pow2 and input_staging queue: the plain rows run the
# staged, padded path; one row turns staging off, one turns CUDA graphs on.
GPU_VARIANTS = (
    Variant("fp32", "fp32"),
    Variant("amp-fp16", "amp-fp16"),
    Variant("amp-bf16", "amp-bf16"),
    Variant("fp16-weights", "fp16-weights"),
    Variant("amp-fp16+graphs", "amp-fp16", (("cuda_graphs", True),)),
    Variant("fp32 staged-at-batch", "fp32", (("input_staging", "batch"),)),
)
# fp16 autocast on the CPU is neither fast nor served there; "pow2" means default_buckets.
CPU_VARIANTS = (
    Variant("fp32", "fp32"),
    Variant("amp-bf16", "amp-bf16"),
    Variant("fp32 buckets+staging", "fp32", (("buckets", "pow2"), ("input_staging", "queue"))),
)
TOLERANCES = {"fp32": 1e-4, "amp-fp16": 2e-2, "amp-bf16": 5e-2,  # max |err| / max |ref|
              "fp16-weights": 2e-2}
POOL_BYTES_A = 512 << 20  # the cap of the device pool the served models of (a) are admitted into
TF32_TOLERANCE = 2e-3  # fp32 where TF32 may apply: 10-bit mantissa
REQUESTS_PER_SIZE = 4  # of each size 1, 7 and max, all sent at once
AUTOCAST_INERT_BELOW = 1e-6  # an fp16/bf16 error this small means autocast did not apply
SERVE_TIMEOUT_S = 60.0
TOKEN_IDS_HIGH = 1000  # integer inputs are token ids below the smallest vocabulary (encoder's)

# -- (b) allocator trace ------------------------------------------------------------------------
TRACE_SEED = 4
POOL_TRACE_SEEDS = tuple(range(8))  # mixed_trace seeds replayed through both allocators
POOL_TRACE_STEPS = 2000
POOL_SEARCH_PRECISION = 0.005
ALLOC_CONFS = ("", "expandable_segments:True")
# The server's own trace: the allocator settings compared, as (label, PYTORCH_ALLOC_CONF,
# per-model pools).
SERVER_TRACE_MODES = (
    ("per-model pools", "expandable_segments:True", True),
    ("PyTorch default", "expandable_segments:False", False),
    ("expandable_segments alone", "expandable_segments:True", False),
)
SERVER_TRACE_ROUNDS = 60  # rounds of SERVER_TRACE_WIDTH requests over the loaded models
SERVER_TRACE_WIDTH = 16
SERVER_TRACE_SECONDS = 25.0
SERVER_TRACE_POOL_BYTES = 256 << 20  # the cap of the device pool the plans are admitted into

# -- (c) throughput and (e) busy % -------------------------------------------------------------
THROUGHPUT_BATCH = 64
INPROCESS_SECONDS = 2.0
# A traced module's profiling executor ran its first ~11 calls 10x slower (CPU, here).
INPROCESS_WARMUP_CALLS = 20
LOAD_SECONDS = 8.0
LOAD_PROCESSES = 8  # the client's per-request Python work must not be the bottleneck
LOAD_CONCURRENCY = 128  # requests in flight, over all load processes
LOAD_READY_TIMEOUT_S = 30.0
LATENCY_SAMPLES = 20000  # per load process, for p50/p99
GATEWAY_QUEUE_DELAY_US = 1000
NVML_INTERVAL_S = 0.1
NVML_SETTLE_S = 1.0  # samples from the load's first second are left out (ramp-up)

# -- (d) host-to-device --------------------------------------------------------------------------
H2D_CASES = (("mlp", 64), ("cnn", 32))
GATHER_REQUESTS = 64  # single-sample requests per batch, as the executor gathers them
GATHER_INPUT = (3, 224, 224)  # ResNet-sized
GATHER_BATCHES = 12
ARENA_PIN_BYTES = 512 << 20
H2D_WARMUP = 5
H2D_REPEATS = 30

# Input of each example model, as in models/<name>/config.pbtxt: (b) and (d) need only torch.
EXAMPLE_INPUTS: dict[str, tuple[tuple[int, ...], str]] = {
    "mlp": ((512,), "float32"),
    "cnn": ((3, 32, 32), "float32"),
    "encoder": ((16,), "int64"),
}

BIG_ENCODER_SOURCE = '''\
"""gpu_check's bigger encoder: INT64 token ids [128] -> mean-pooled FP32 [512].

d_model 512, 6 layers, 8 heads, feed-forward 2048, vocabulary 8192; weights from a fixed seed.
"""

import torch
from torch import nn

SEED = 20240515
VOCAB = 8192
SEQUENCE = 128
D_MODEL = 512


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, D_MODEL)
        self.positions = nn.Parameter(torch.randn(SEQUENCE, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model=D_MODEL, nhead=8, dim_feedforward=4 * D_MODEL, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False)

    def forward(self, ids):
        return self.encoder(self.tokens(ids) + self.positions).mean(dim=1)


def build_model(parameters):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Encoder()
    return model.eval()
'''

RESNET50_SOURCE = '''\
"""ResNet-50 with random weights (nothing is downloaded): FP32 [3, 224, 224] -> [1000]."""

import torch
import torchvision


def build_model(parameters):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20240516)
        model = torchvision.models.resnet50(weights=None)
    return model.eval()
'''


@dataclasses.dataclass(frozen=True)
class ThroughputModel:
    """A model of section (c): where its ``model.py`` comes from and its one input and output."""

    name: str
    label: str
    source: Path | str  # a model.py to copy, or its text
    input_dims: tuple[int, ...]
    input_dtype: str  # numpy dtype name
    output_dims: tuple[int, ...]


def throughput_models() -> list[ThroughputModel]:
    return [
        ThroughputModel("encoder", "encoder (example: d64 x2, seq 16, traced)",
                        ROOT / "models" / "encoder" / "1" / "model.py", (16,), "int64", (64,)),
        ThroughputModel("encoder_big", "encoder d512 x6, seq 128 (eager)",
                        BIG_ENCODER_SOURCE, (128,), "int64", (512,)),
        ThroughputModel("resnet50", "ResNet-50 (torchvision, random weights)",
                        RESNET50_SOURCE, (3, 224, 224), "float32", (1000,)),
    ]


# -- the table -----------------------------------------------------------------------------------

PASS, FAIL, INFO, SKIP, ERROR = "PASS", "FAIL", "INFO", "SKIP", "ERROR"


@dataclasses.dataclass
class Row:
    section: str
    check: str
    result: str
    status: str
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


class Report:
    """Rows as they come (each printed at once), section timings, and the final table."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.sections: dict[str, dict[str, Any]] = {}
        self.machine: dict[str, Any] = {}
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def add(self, section: str, check: str, result: str, status: str, **data: Any) -> Row:
        row = Row(section, check, result, status, data)
        with self._lock:
            self.rows.append(row)
        say(f"  [{section}] {check}: {result}  {status}")
        return row

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def correctness_failed(self) -> bool:
        return any(r.section == "a" and r.status in (FAIL, ERROR) for r in self.rows)

    def table(self) -> str:
        with self._lock:
            rows = list(self.rows)
        width = min(44, max([len(r.check) for r in rows] + [5]))
        lines = [f"{'':2}{'check':<{width}}  {'status':<9}  result"]
        for section in [*"abcdet", "run"]:
            chosen = [r for r in rows if r.section == section]
            if not chosen:
                continue
            timing = self.sections.get(section, {}).get("elapsed_s")
            spent = f" ({timing:.1f} s)" if timing is not None else ""
            lines.append(f"({section}) {SECTION_TITLES[section]}{spent}")
            lines.extend(f"{'':2}{r.check:<{width}}  {r.status:<9}  {r.result}" for r in chosen)
        return "\n".join(lines)

    def to_json(self, exit_code: int | None) -> dict[str, Any]:
        with self._lock:
            rows = [dataclasses.asdict(r) for r in self.rows]
        return {"machine": self.machine, "sections": self.sections, "rows": rows,
                "elapsed_s": round(self.elapsed(), 2), "exit_code": exit_code}


SECTION_TITLES = {
    "a": "correctness: served on the device vs the CPU in fp32",
    "b": "memory: in use / reserved on a mixed multi-model trace",
    "c": "throughput: in-process loop vs the whole gateway",
    "d": "host-to-device time on the critical path",
    "e": "GPU busy % under load (NVML)",
    "t": "pytest -m cuda on this machine",
    "run": "the run as a whole",
}


def say(text: str) -> None:
    print(text, flush=True)


class Budget:
    """A section's time allowance; the run's soft limit caps it too."""

    def __init__(self, report: Report, seconds: float) -> None:
        self._deadline = min(time.monotonic() + seconds, report.started + SOFT_LIMIT_S)

    def left(self) -> float:
        return self._deadline - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0


def run_section(report: Report, section: str, budget_s: float,
                body: Callable[[Report, Budget], None]) -> None:
    """Run one section; an exception becomes an ERROR row and the run goes on."""
    started = time.monotonic()
    say(f"({section}) {SECTION_TITLES[section]}: budget {budget_s:.0f} s, "
        f"run at {report.elapsed():.0f} s")
    info: dict[str, Any] = {"budget_s": budget_s}
    report.sections[section] = info
    if report.elapsed() >= SOFT_LIMIT_S:
        report.add(section, "section", f"not run: the run passed its {SOFT_LIMIT_S:.0f} s limit", SKIP)
    else:
        try:
            body(report, Budget(report, budget_s))
        except Exception as exc:
            info["error"] = f"{type(exc).__name__}: {exc}"
            info["traceback"] = traceback.format_exc()
            sys.stderr.write(info["traceback"])
            report.add(section, "section", f"raised {_chain(exc)}", ERROR)
    info["elapsed_s"] = round(time.monotonic() - started, 2)
    say(f"({section}) done in {info['elapsed_s']:.1f} s")


def _summary(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()
    first = text[0].strip() if text else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _chain(exc: BaseException) -> str:
    """The exception and what caused it: the project's errors keep details out of messages."""
    parts = [_summary(exc)]
    cause = exc.__cause__ or exc.__context__
    while cause is not None and len(parts) < 3:
        parts.append(_summary(cause, 200))
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(parts)


# -- environment ---------------------------------------------------------------------------------

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
            from server.logs import configure_logging

            configure_logging("warning", "console")  # keep the server's info lines off the tail
        except Exception as exc:  # the check still runs with structlog's defaults
            return f"structlog set-up failed ({_summary(exc)})"
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
    for module in ("batcher.model", "server.model_config", "server.app", "clients"):
        try:
            importlib.import_module(module)
            found[module] = "ok"
        except Exception as exc:
            found[module] = _summary(exc)
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
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        )
    return facts


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
        say(f"tf32 allowed: matmul {m['tf32']['matmul']}, cudnn {m['tf32']['cudnn']}; "
            f"PYTORCH_CUDA_ALLOC_CONF={m['alloc_conf']!r}")
    say("packages: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()))
    if m.get("structlog_note"):
        say(m["structlog_note"])
    say("imports: " + ", ".join(f"{k} {v}" for k, v in m.get("imports", {}).items()))


# -- helpers shared by the sections -------------------------------------------------------------

_source_numbers = itertools.count(1)


def build_from_source(path: Path, device: str) -> Any:
    """``build_model({})`` of a model.py, on ``device``, in eval mode (torch only, no batcher)."""
    name = f"gpu_check_model_{next(_source_numbers)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.build_model({}).to(device).eval()


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(0, TOKEN_IDS_HIGH, shape).astype(dtype)
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def random_tensor(shape: tuple[int, ...], dtype: str, device: str) -> Any:
    import torch

    if dtype == "int64":
        return torch.randint(0, TOKEN_IDS_HIGH, shape, device=device)
    return torch.randn(shape, device=device)


def autocast_for(precision: str, device: str) -> contextlib.AbstractContextManager:
    import torch

    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    if precision not in dtypes:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtypes[precision])


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def torchvision_problem() -> str:
    """Why ResNet-50 cannot be built here ("" when torchvision imports)."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # a torchvision built for another torch fails here too
        return f"torchvision does not import ({_summary(exc, 100)})"
    return ""


def has_convolutions(module: Any) -> bool:
    # A traced module's submodules are ScriptModules that keep the eager class name here.
    return any((getattr(m, "original_name", "") or type(m).__name__).startswith("Conv")
               for m in module.modules())


def tensors_of(returned: Any) -> list[Any]:
    if isinstance(returned, dict):
        return list(returned.values())
    if isinstance(returned, (tuple, list)):
        return list(returned)
    return [returned]


# -- (a) correctness -----------------------------------------------------------------------------


def section_correctness(report: Report, budget: Budget, device: str,
                        variants: Sequence[Variant], models: Sequence[str]) -> None:
    from batcher.buckets import default_buckets
    from batcher.loading import find_artifact, load_module
    from batcher.memory import DevicePools, PoolSettings
    from server.model_config import read_model_config
    from server.model_spec import model_spec_from_config

    cuda = device.startswith("cuda")
    pools = DevicePools(PoolSettings(POOL_BYTES_A))
    # TF32 unknown (None) counts as on: a false FAIL would cost a GPU run to tell apart.
    tf32 = {k: v is not False for k, v in tf32_flags().items()} if cuda else {}
    rng = np.random.default_rng()  # fresh inputs every run: any valid input must pass
    for name in models:
        model_dir = ROOT / "models" / name
        try:
            config, _ = read_model_config(model_dir)
            filename = config.default_model_filename or None
            version_dir = max((d for d in model_dir.iterdir()
                               if d.name.isdigit() and find_artifact(d, filename)),
                              key=lambda d: int(d.name))
            base = model_spec_from_config(config, version_dir.name, cuda_available=cuda)
            parameters = {k: v.string_value for k, v in config.parameters.items()}
            reference = load_module(version_dir, filename=filename, parameters=parameters,
                                    device="cpu")
        except Exception as exc:
            sys.stderr.write(traceback.format_exc())
            report.add("a", name, f"could not load: {_chain(exc)}", ERROR)
            continue
        max_batch = base.batching.max_batch_size
        if max_batch < 1:
            report.add("a", name, "max_batch_size 0: this check needs a batching model", ERROR)
            continue
        sizes = sorted({1, min(7, max_batch), max_batch})
        for variant in variants:
            check = f"{name} {variant.label} on {device}"
            if budget.over():
                report.add("a", check, "not run: over the section's budget", FAIL)
                continue
            fields = dict(variant.fields)
            if fields.get("buckets") == "pow2":
                fields["buckets"] = default_buckets(max_batch)
            spec = dataclasses.replace(base, device=device, precision=variant.precision,
                                       **fields)
            tolerance = TOLERANCES[variant.precision]
            if variant.precision == "fp32" and (tf32.get("matmul") or (
                    tf32.get("cudnn") and has_convolutions(reference))):
                tolerance = TF32_TOLERANCE
            try:
                # A module of its own: fp16 weights convert the module they are given.
                served_module = load_module(version_dir, filename=filename,
                                            parameters=parameters, device=device)
                row = correctness_case(spec, served_module, reference, sizes, tolerance, rng,
                                       pools)
            except Exception as exc:
                sys.stderr.write(traceback.format_exc())
                report.add("a", check, f"raised {_chain(exc)}", ERROR)
                continue
            report.add("a", check, row.pop("result"), row.pop("status"), **row)


def correctness_case(spec: Any, module: Any, reference: Any, sizes: list[int], tolerance: float,
                     rng: np.random.Generator, pools: Any) -> dict[str, Any]:
    """Serve requests of ``sizes`` rows (REQUESTS_PER_SIZE of each, all at once) through a
    ServedModel of ``spec`` admitted into ``pools``; compare every answer with ``reference`` run
    on the CPU alone. CUDA graphs that were asked for but not captured fail the row."""
    import torch

    from batcher.model import ServedModel
    from batcher.request import InferenceRequest

    requests_arrays = [
        [random_array(rng, (size, *t.dims), t.numpy_dtype.name) for t in spec.inputs]
        for size in sizes * REQUESTS_PER_SIZE
    ]
    rng.shuffle(requests_arrays)

    served = ServedModel(spec, module, pools=pools)
    served.start()
    load_report = dict(served.load_report)
    try:
        async def serve_all() -> list[dict[str, np.ndarray]]:
            requests = [InferenceRequest(arrays, batch_size=arrays[0].shape[0])
                        for arrays in requests_arrays]
            return await asyncio.wait_for(
                asyncio.gather(*(served.infer(r) for r in requests)), SERVE_TIMEOUT_S)

        answers = asyncio.run(serve_all())
    finally:
        served.stop(5.0)
    batches = served.stats.snapshot().execution_count

    worst_abs = 0.0
    ref_max = 0.0
    finite = True
    for arrays, answer in zip(requests_arrays, answers):
        with torch.inference_mode():
            expected = tensors_of(reference(*[torch.from_numpy(a.copy()) for a in arrays]))
        for out_spec, want in zip(spec.outputs, expected):
            want = want.float().numpy()
            got = np.asarray(answer[out_spec.name], dtype=np.float32)
            if got.shape != want.shape:
                return {"result": f"output {out_spec.name} has shape {got.shape}, "
                                  f"the CPU reference {want.shape}", "status": FAIL}
            finite = finite and bool(np.isfinite(got).all())
            worst_abs = max(worst_abs, float(np.abs(got - want).max(initial=0.0)))
            ref_max = max(ref_max, float(np.abs(want).max(initial=0.0)))
    relative = worst_abs / ref_max if ref_max > 0 else float("inf")
    graphs = load_report.get("cuda_graphs_status", "off")
    captured = not spec.cuda_graphs or graphs.startswith("captured")
    ok = finite and relative <= tolerance and captured
    notes = []
    if not captured:
        notes.append(f"CUDA graphs not captured: {graphs}")
    if not finite:
        notes.append("non-finite outputs")
    if spec.precision != "fp32" and relative < AUTOCAST_INERT_BELOW:
        notes.append("error at fp32 level: did autocast apply?")
    if batches >= len(requests_arrays):
        notes.append("no two requests shared a batch")
    result = (f"max|err| {worst_abs:.2e}, rel {relative:.2e} <= {tolerance:.0e}? "
              f"{len(requests_arrays)} requests (sizes {'/'.join(map(str, sizes))}) "
              f"in {batches} batches" + ("; " + "; ".join(notes) if notes else ""))
    return {"result": result, "status": PASS if ok else FAIL, "max_abs_error": worst_abs,
            "max_relative_error": relative, "tolerance": tolerance, "max_abs_reference": ref_max,
            "requests": len(requests_arrays), "batches": batches, "sizes": sizes,
            "finite": finite, "load_report": load_report, "buckets": list(spec.buckets),
            "input_staging": spec.input_staging}


# -- (b) allocator trace -------------------------------------------------------------------------


def section_memory(report: Report, budget: Budget, device: str) -> None:
    """Our pool on the allocation trace; on a GPU, the caching allocator on the same trace and
    on real forwards of several models, each allocator setting in its own process."""
    mib = 2**20
    per_seed = [pool_trace_figure(device, seed) for seed in POOL_TRACE_SEEDS]
    ours = {"ratio": sum(r["peak_in_use_fraction"] for r in per_seed) / len(per_seed),
            "min_ratio": min(r["peak_in_use_fraction"] for r in per_seed), "seeds": per_seed}
    report.add(
        "b", f"batchgate pool, mixed traces, on {device}",
        f"peak in use / reserved {ours['ratio']:.1%} on average, {ours['min_ratio']:.1%} at "
        f"worst, over {len(per_seed)} seeded traces (each in the smallest arena that serves it; "
        f"peak live {min(r['peak_live_bytes'] for r in per_seed) / mib:.1f}-"
        f"{max(r['peak_live_bytes'] for r in per_seed) / mib:.1f} MiB; "
        f"{sum(r['refused'] for r in per_seed)} refused)", INFO, **ours)
    if not device.startswith("cuda"):
        report.add("b", "caching allocator, same trace", "needs a CUDA device", SKIP)
        server_trace_rows(report, budget, device)
        return
    theirs = {}
    for conf in ALLOC_CONFS:
        result = alloc_child(report, budget, conf, "--_alloc-replay", "ALLOC_REPLAY ",
                             f"caching allocator, {conf or 'default'}, same trace")
        if result is None:
            continue
        theirs[conf or "default"] = result["ratio"]
        report.add(
            "b", f"caching allocator, {conf or 'default'}, same traces",
            f"peak in use / peak reserved {result['ratio']:.1%} on average, "
            f"{result['min_ratio']:.1%} at worst", INFO, **result)
    if theirs:
        met = ours["ratio"] >= 0.9 and all(ours["ratio"] > r for r in theirs.values())
        report.add("b", "pool vs caching allocator (target >= 90 % and above)",
                   f"ours {ours['ratio']:.1%} vs "
                   + ", ".join(f"{k} {v:.1%}" for k, v in theirs.items())
                   + (": met" if met else ": not met"), INFO, met=met)
    server_trace_rows(report, budget, device)


def server_trace_rows(report: Report, budget: Budget, device: str) -> None:
    """The server's real footprint: ``server_trace_main`` once per SERVER_TRACE_MODES entry,
    each in a process of its own (the allocator setting is read when CUDA starts)."""
    ratios: dict[str, float] = {}
    cuda = device.startswith("cuda")
    for index, (label, conf, pooled) in enumerate(SERVER_TRACE_MODES):
        if not cuda and index:  # on the CPU nothing is measured: one run tests the harness
            break
        check = f"server trace, {label}" + ("" if cuda else " (harness only, on cpu)")
        result = alloc_child(report, budget, conf, f"--_server-trace={device},{index}",
                             "SERVER_TRACE ", check)
        if result is None:
            continue
        served = (f"{result['requests']} requests over {len(result['models'])} models at "
                  f"mixed batch sizes, '{result['unloaded']}' unloaded and "
                  f"'{result['loaded']}' loaded while the rest served, all answers "
                  f"{'correct' if result['correct'] else 'NOT correct'}")
        status = INFO if result["correct"] else FAIL
        if result.get("ratio_end") is None:
            report.add("b", check, f"{served}; device figures unmeasured on the CPU", status,
                       **result)
            continue
        ratios[label] = result["ratio_mean"]
        report.add(
            "b", check,
            f"device in use / reserved {result['ratio_mean']:.1%} on average over the trace, "
            f"{result['ratio_min']:.1%} at worst, {result['ratio_end']:.1%} at its end "
            f"(peak reserved {result['peak_reserved'] / 2**20:.0f} MiB); {served}", status,
            **result)
        graph = result.get("graph_model")
        if graph is not None:
            report.add("b", "graph model loaded while another serves",
                       f"{graph['status']}; max relative error {graph['error']:.2e}",
                       PASS if graph["ok"] else FAIL, **graph)
    ours = ratios.get(SERVER_TRACE_MODES[0][0])
    if ours is not None and len(ratios) > 1:
        others = {k: v for k, v in ratios.items() if k != SERVER_TRACE_MODES[0][0]}
        met = ours >= 0.9 and all(ours > v for v in others.values())
        report.add("b", "per-model pools vs PyTorch (target >= 90 % and above)",
                   f"pools {ours:.1%} vs " + ", ".join(f"{k} {v:.1%}" for k, v in others.items())
                   + (": met" if met else ": not met"), INFO, met=met)


def server_trace_main(argument: str) -> int:
    """Child of (b): what the server itself allocates. ServedModels of several sizes (the
    example models and linear stacks), each with its own pool or not (the mode), served
    requests of random batch sizes concurrently; mid-trace one model is unloaded and another
    loaded while the rest serve; with pools a CUDA-graph model is loaded while the others serve
    and its answers are checked. The device's bytes in use / reserved is sampled after every
    round. Prints one SERVER_TRACE JSON line."""
    import torch

    from batcher.gpu import ModelMemory
    from batcher.memory import DevicePools, PoolSettings
    from batcher.model import ServedModel
    from batcher.request import InferenceRequest
    from batcher.spec import BatchingConfig, ModelSpec, TensorSpec

    device, index = argument.split(",")
    label, _conf, pooled = SERVER_TRACE_MODES[int(index)]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.init()
    pools = DevicePools(PoolSettings(SERVER_TRACE_POOL_BYTES))
    rng = np.random.default_rng(TRACE_SEED)
    stacks = (((256, 4), 64), ((1024, 4), 128), ((4096, 3), 64), ((2048, 3), 128))
    if not cuda:
        stacks = (((64, 2), 16), ((128, 2), 16), ((256, 2), 8), ((96, 2), 16))

    def linear(width: int, layers: int, seed: int) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return torch.nn.Sequential(*[torch.nn.Linear(width, width)
                                         for _ in range(layers)]).eval()

    def served(name: str, width: int, layers: int, max_batch: int, seed: int,
               **fields: Any) -> tuple[Any, Any]:
        memory = ModelMemory(device, name, pooled=pooled)
        cpu_module = linear(width, layers, seed)
        with memory.use():
            module = linear(width, layers, seed).to(device)
        spec = ModelSpec(name=name, version="1", platform="test", device=device,
                         inputs=(TensorSpec("x", "FP32", (width,)),),
                         outputs=(TensorSpec("y", "FP32", (width,)),),
                         batching=BatchingConfig(max_batch_size=max_batch), **fields)
        model = ServedModel(spec, module, pools=pools, memory=memory)
        model.start()
        return model, cpu_module

    models: dict[str, tuple[Any, Any]] = {}
    for number, ((width, layers), max_batch) in enumerate(stacks[:3]):
        name = f"linear{width}x{layers}"
        models[name] = served(name, width, layers, max_batch, number)
    samples: list[float] = []
    correct = True
    requests = 0
    unloaded = next(iter(models))
    (late_width, late_layers), late_batch = stacks[3]
    loaded = f"linear{late_width}x{late_layers}"
    graph: dict[str, Any] | None = None

    def sample() -> None:
        if cuda:
            torch.cuda.synchronize()
            reserved = torch.cuda.memory_reserved()
            if reserved:
                samples.append(torch.cuda.memory_allocated() / reserved)

    async def one(model: Any, cpu_module: Any, rows: int) -> bool:
        x = rng.standard_normal((rows, model.spec.inputs[0].dims[0]), dtype=np.float32)
        out = (await model.infer(InferenceRequest([x], batch_size=rows)))["y"]
        with torch.inference_mode():
            want = cpu_module(torch.from_numpy(x)).numpy()
        return bool(np.abs(out - want).max() <= 1e-3 * max(1.0, float(np.abs(want).max())))

    async def trace() -> None:
        nonlocal correct, requests, graph
        started = time.monotonic()
        swap: asyncio.Future | None = None
        graph_load: asyncio.Future | None = None
        for round_number in range(SERVER_TRACE_ROUNDS):
            if time.monotonic() - started > SERVER_TRACE_SECONDS:
                break
            if round_number == SERVER_TRACE_ROUNDS // 3:
                # Unload one model and load another while the rest keep serving.
                gone = models.pop(unloaded)[0]
                swap = asyncio.ensure_future(asyncio.gather(
                    asyncio.to_thread(gone.stop, 5.0),
                    asyncio.to_thread(served, loaded, late_width, late_layers, late_batch, 7)))
            if round_number == SERVER_TRACE_ROUNDS // 2 and cuda and pooled:
                graph_load = asyncio.ensure_future(asyncio.to_thread(
                    served, "graphs", 512, 3, 64, 11, cuda_graphs=True, buckets=(1, 8, 64)))
            if swap is not None and swap.done():
                models[loaded] = swap.result()[1]
                swap = None
            if graph_load is not None and graph_load.done():
                model, cpu_module = graph_load.result()
                results = await asyncio.gather(*(one(model, cpu_module, rows)
                                                 for rows in (1, 5, 8, 33, 64)))
                graph = {"status": model.load_report.get("cuda_graphs_status", ""),
                         "ok": all(results) and model.load_report.get(
                             "cuda_graphs_status", "").startswith("captured"),
                         "error": 0.0 if all(results) else 1.0}
                model.stop(5.0)
                graph_load = None
            names = list(models)
            jobs = []
            for _ in range(SERVER_TRACE_WIDTH):
                model, cpu_module = models[names[int(rng.integers(len(names)))]]
                jobs.append(one(model, cpu_module,
                                int(rng.integers(1, model.spec.max_batch_size + 1))))
            results = await asyncio.gather(*jobs)
            correct = correct and all(results)
            requests += len(results)
            sample()
        if swap is not None:
            models[loaded] = (await swap)[1]
        if graph_load is not None:
            model, _ = await graph_load
            graph = {"status": "loaded after the trace ended", "ok": False, "error": 1.0}
            model.stop(5.0)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    asyncio.run(trace())
    result: dict[str, Any] = {
        "mode": label, "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
        "pooled": pooled, "models": sorted([*models, unloaded]), "unloaded": unloaded,
        "loaded": loaded, "requests": requests, "correct": correct, "graph_model": graph,
        "ratio_end": None, "ratio_mean": None, "ratio_min": None,
    }
    if cuda and samples:
        result.update(ratio_end=samples[-1], ratio_mean=sum(samples) / len(samples),
                      ratio_min=min(samples), peak_reserved=torch.cuda.max_memory_reserved(),
                      peak_allocated=torch.cuda.max_memory_allocated(),
                      fragmentation_end=torch.cuda.memory_reserved()
                      - torch.cuda.memory_allocated())
    for model, _ in models.values():
        model.stop(5.0)
    print("SERVER_TRACE " + json.dumps(result), flush=True)
    return 0


def alloc_child(report: Report, budget: Budget, conf: str, flag: str, marker: str,
                label: str) -> dict[str, Any] | None:
    """Run this script's ``flag`` child under ``PYTORCH_CUDA_ALLOC_CONF=conf`` (read when CUDA
    starts, hence a process each); its marked JSON line, or None with an ERROR/SKIP row."""
    timeout = min(B_SUBPROCESS_TIMEOUT_S, budget.left())
    if timeout < 10:
        report.add("b", label, "not run: over the section's budget", SKIP)
        return None
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_ALLOC_CONF"] = conf
    try:
        out = run_child([sys.executable, str(Path(__file__).resolve()), flag], env=env,
                        timeout_s=timeout)
    except subprocess.TimeoutExpired:
        report.add("b", label, f"the subprocess ran past {timeout:.0f} s", ERROR)
        return None
    result = marked_json(out.stdout, marker)
    if out.returncode != 0 or result is None:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
        report.add("b", label, f"subprocess exit {out.returncode}: {tail}", ERROR)
        return None
    return result


def pool_trace_figure(device: str, seed: int) -> dict[str, Any]:
    """``mixed_trace(seed)`` through our pool: the smallest arena that serves it with no refusal
    (bisection to POOL_SEARCH_PRECISION of the trace's peak live bytes), then the replay's
    figures in that arena. An operator sizes the pool once; this is the best that sizing does."""
    from batcher.pool import DevicePool, mixed_trace, peak_live_bytes, replay_trace

    trace = mixed_trace(seed, steps=POOL_TRACE_STEPS)
    live = peak_live_bytes(trace)

    def refused(size: int) -> bool:
        return replay_trace(lambda: DevicePool(device, size), trace)["refused"] > 0

    low, high = live - 1, live
    while refused(high):
        low, high = high, high * 2
    while high - low > live * POOL_SEARCH_PRECISION:
        middle = (low + high) // 2
        if refused(middle):
            low = middle
        else:
            high = middle
    result = replay_trace(lambda: DevicePool(device, high), trace)
    result.update(seed=seed, steps=POOL_TRACE_STEPS)
    return result


def alloc_replay_main() -> int:
    """Child of (b): the ``mixed_trace`` seeds replayed through the caching allocator
    (``torch.empty`` and drop), each from an empty cache, under whatever
    PYTORCH_CUDA_ALLOC_CONF it was started with."""
    import torch

    from batcher.pool import mixed_trace, peak_live_bytes

    torch.cuda.init()
    seeds = []
    for seed in POOL_TRACE_SEEDS:
        trace = mixed_trace(seed, steps=POOL_TRACE_STEPS)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        live: dict[str, Any] = {}
        for event in trace:
            if event[0] == "alloc":
                live[event[1]] = torch.empty(event[2], dtype=torch.uint8, device="cuda")
            else:
                live.pop(event[1], None)
        live.clear()
        torch.cuda.synchronize()
        allocated = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
        seeds.append({"seed": seed, "peak_live_bytes": peak_live_bytes(trace),
                      "peak_allocated": allocated, "peak_reserved": reserved,
                      "ratio": allocated / reserved if reserved else 0.0,
                      "segments_peak": torch.cuda.memory_stats().get("segment.all.peak", 0)})
    print("ALLOC_REPLAY " + json.dumps({
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
        "ratio": sum(s["ratio"] for s in seeds) / len(seeds),
        "min_ratio": min(s["ratio"] for s in seeds),
        "seeds": seeds,
    }), flush=True)
    return 0


_children: list[subprocess.Popen] = []
_children_lock = threading.Lock()


def run_child(command: list[str], *, env: dict[str, str] | None, timeout_s: float
              ) -> subprocess.CompletedProcess:
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT) as proc:
        with _children_lock:
            _children.append(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        finally:
            with _children_lock:
                _children.remove(proc)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def marked_json(text: str, marker: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    return None


# -- (c) throughput and (e) busy % -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ThroughputSettings:
    device: str
    precision: str  # the amp precision compared with fp32 and served by the gateway
    batch: int
    inprocess_s: float
    load_s: float
    processes: int
    concurrency: int
    models: tuple[str, ...]


GPU_THROUGHPUT = ThroughputSettings("cuda:0", "fp16", THROUGHPUT_BATCH, INPROCESS_SECONDS,
                                    LOAD_SECONDS, LOAD_PROCESSES, LOAD_CONCURRENCY,
                                    ("encoder", "encoder_big", "resnet50"))
# The same harness on a CPU, small enough to prove its code paths in seconds.
CPU_THROUGHPUT = ThroughputSettings("cpu", "bf16", 8, 0.3, 1.5, 2, 8, ("encoder",))


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
            self.unavailable = f"pynvml (nvidia-ml-py) does not import: {_summary(exc)}"
            return
        try:
            pynvml.nvmlInit()
            self._handle = self._device_handle(pynvml)
        except Exception as exc:
            self.unavailable = f"NVML unavailable: {_summary(exc)}"
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


def inprocess_rate(module: Any, model: ThroughputModel, settings: ThroughputSettings,
                   precision: str) -> dict[str, Any]:
    """Samples/s of ``module`` called back to back on one fixed batch already on the device."""
    import torch

    x = random_tensor((settings.batch, *model.input_dims), model.input_dtype, settings.device)
    with torch.inference_mode(), autocast_for(precision, settings.device):
        for _ in range(INPROCESS_WARMUP_CALLS):
            module(x)
        synchronize(settings.device)
        started = time.monotonic()  # the NVML samples' clock
        calls = 0
        while True:
            module(x)
            calls += 1
            # The host runs ahead of the device; the synchronize below settles the account.
            if calls % 4 == 0 and time.monotonic() - started >= settings.inprocess_s:
                break
        synchronize(settings.device)
        wall = time.monotonic() - started
    return {"samples_per_s": calls * settings.batch / wall, "calls": calls, "seconds": wall,
            "window": (started, started + wall)}


def inprocess_graph_rate(module: Any, model: ThroughputModel, settings: ThroughputSettings,
                         precision: str) -> dict[str, Any]:
    """Samples/s of one CUDA graph of ``module`` at the batch, replayed back to back."""
    import torch

    from batcher import precision as precisions

    amp = f"amp-{precision}"
    x = random_tensor((settings.batch, *model.input_dims), model.input_dtype, settings.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode(), autocast_for(precision, settings.device):
        for _ in range(INPROCESS_WARMUP_CALLS):
            module(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph), \
            precisions.autocast(amp, "cuda", capturing=True):
        module(x)
    synchronize(settings.device)
    started = time.monotonic()
    calls = 0
    while True:
        graph.replay()
        calls += 1
        if calls % 4 == 0 and time.monotonic() - started >= settings.inprocess_s:
            break
    synchronize(settings.device)
    wall = time.monotonic() - started
    return {"samples_per_s": calls * settings.batch / wall, "calls": calls, "seconds": wall}


def write_model(repository: Path, model: ThroughputModel, settings: ThroughputSettings,
                graphs: bool = False) -> Path:
    folder = repository / model.name
    (folder / "1").mkdir(parents=True)
    target = folder / "1" / "model.py"
    if isinstance(model.source, Path):
        shutil.copyfile(model.source, target)
    else:
        target.write_text(model.source)
    datatype = {"int64": "TYPE_INT64", "float32": "TYPE_FP32"}[model.input_dtype]
    kind = "KIND_GPU" if settings.device.startswith("cuda") else "KIND_CPU"
    (folder / "config.pbtxt").write_text(textwrap.dedent(f"""\
        name: "{model.name}"
        backend: "pytorch"
        max_batch_size: {settings.batch}
        input [ {{ name: "INPUT__0" data_type: {datatype} dims: [ {", ".join(map(str, model.input_dims))} ] }} ]
        output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {", ".join(map(str, model.output_dims))} ] }} ]
        dynamic_batching {{
          preferred_batch_size: [ {settings.batch} ]
          max_queue_delay_microseconds: {GATEWAY_QUEUE_DELAY_US}
        }}
        instance_group [ {{ kind: {kind} count: 1 }} ]
        parameters {{ key: "precision" value: {{ string_value: "{settings.precision}" }} }}
        parameters {{ key: "cuda_graphs" value: {{ string_value: "{str(graphs).lower()}" }} }}
        """))
    return target


class RunningGateway:
    """The whole server (``server.app.Gateway``) on port 0, on its own thread and event loop."""

    def __init__(self, repository: Path) -> None:
        from server.app import Gateway, Settings

        settings = Settings(host="127.0.0.1", grpc_port=0, metrics_port=None,
                            model_repository=repository)
        self.gateway = Gateway(settings)
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="gateway", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.gateway.start())
        except BaseException as exc:  # handed to start() below
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    def start(self, timeout_s: float) -> None:
        self.thread.start()
        if not self._started.wait(timeout_s):
            raise TimeoutError(f"the gateway did not start within {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.grpc_port}"

    def stop(self) -> None:
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(
                    self.gateway.stop(drain_timeout_s=5.0), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def section_throughput(report: Report, budget: Budget, settings: ThroughputSettings) -> None:
    import torch

    cuda = settings.device.startswith("cuda")
    nvml = NvmlSampler() if cuda else None
    if nvml is None:
        report.add("e", "NVML sampling", "no CUDA device: not sampled", SKIP)
    elif nvml.unavailable:
        report.add("e", "NVML sampling", nvml.unavailable, SKIP)

    repository = Path(tempfile.mkdtemp(prefix="gpu_check_repository_"))
    amp = f"amp-{settings.precision}"
    try:
        # (served name, check label, its in-process rate at the same precision and path)
        served: list[tuple[ThroughputModel, str, float]] = []
        for model in throughput_models():
            if model.name not in settings.models:
                continue
            problem = torchvision_problem() if model.name == "resnet50" else ""
            if problem:
                report.add("c", model.label, f"skipped: {problem}", SKIP)
                continue
            if budget.left() < 5 * settings.inprocess_s + 10:
                report.add("c", model.label, "not run: over the section's budget", SKIP)
                continue
            graphed = dataclasses.replace(model, name=f"{model.name}_graphs")
            try:
                path = write_model(repository, model, settings)
                module = build_from_source(path, settings.device)
                rates = {p: inprocess_rate(module, model, settings, p)
                         for p in ("fp32", settings.precision)}
                if cuda:
                    write_model(repository, graphed, settings, graphs=True)
                    rates["graphs"] = inprocess_graph_rate(module, model, settings,
                                                           settings.precision)
                # The amp loop again, sampled by NVML: the busy % of the in-process ceiling.
                if nvml is not None and not nvml.unavailable:
                    with nvml:
                        again = inprocess_rate(module, model, settings, settings.precision)
                    text, figures = busy_summary(nvml.between(*again["window"]))
                    report.add("e", f"{model.name} in-process loop (reference)", text, INFO,
                               **figures)
                del module
            except Exception as exc:
                sys.stderr.write(traceback.format_exc())
                report.add("c", model.label, f"in-process loop raised {_chain(exc)}", ERROR)
                shutil.rmtree(repository / model.name, ignore_errors=True)
                shutil.rmtree(repository / graphed.name, ignore_errors=True)
                continue
            fp32 = rates["fp32"]["samples_per_s"]
            amp_rate = rates[settings.precision]["samples_per_s"]
            prefix = f"{model.name} in-process b{settings.batch}"
            report.add("c", f"{prefix} fp32", f"{fp32:,.0f} samples/s", INFO, samples_per_s=fp32)
            report.add("c", f"{prefix} {amp}",
                       f"{amp_rate:,.0f} samples/s ({amp_rate / fp32:.2f}x fp32)", INFO,
                       samples_per_s=amp_rate, speedup_vs_fp32=amp_rate / fp32)
            served.append((model, f"{model.name} gateway {amp} c{settings.concurrency}",
                           amp_rate))
            if "graphs" in rates:
                graph_rate = rates["graphs"]["samples_per_s"]
                report.add("c", f"{prefix} {amp}+graphs",
                           f"{graph_rate:,.0f} samples/s ({graph_rate / fp32:.2f}x fp32, "
                           f"{graph_rate / amp_rate:.2f}x eager {amp})", INFO,
                           samples_per_s=graph_rate, speedup_vs_fp32=graph_rate / fp32)
                served.append((graphed,
                               f"{model.name} gateway {amp}+graphs c{settings.concurrency}",
                               graph_rate))
            else:
                report.add("c", f"{prefix} {amp}+graphs", "needs a CUDA device", SKIP)
        if cuda:
            torch.cuda.empty_cache()
        if not served:
            return
        gateway_load(report, budget, settings, repository, served, nvml)
    finally:
        shutil.rmtree(repository, ignore_errors=True)


def gateway_load(report: Report, budget: Budget, settings: ThroughputSettings, repository: Path,
                 served: list[tuple[ThroughputModel, str, float]],
                 nvml: NvmlSampler | None) -> None:
    running = RunningGateway(repository)
    try:
        running.start(timeout_s=max(budget.left(), 10))
        states = {e.name: e for e in running.gateway.repository.index()}
        for model, check, inprocess in served:
            entry = states.get(model.name)
            if entry is None or entry.state != "READY":
                reason = entry.reason if entry is not None else "not in the repository"
                report.add("c", check, f"model not READY: {reason}", ERROR)
                continue
            if budget.left() < settings.load_s + 10:
                report.add("c", check, "not run: over the section's budget", SKIP)
                continue
            try:
                one_load(report, settings, running, model, inprocess, check, nvml)
            except Exception as exc:
                sys.stderr.write(traceback.format_exc())
                report.add("c", check, f"raised {_chain(exc)}", ERROR)
    finally:
        running.stop()


def one_load(report: Report, settings: ThroughputSettings, running: RunningGateway,
             model: ThroughputModel, inprocess_amp: float, check: str,
             nvml: NvmlSampler | None) -> None:
    served_model = running.gateway.repository.get(model.name)
    before = served_model.stats.snapshot()
    workers = LoadWorkers(running.address, model, settings)
    try:
        workers.wait_ready(LOAD_READY_TIMEOUT_S)
        sampling = nvml if nvml is not None and not nvml.unavailable else contextlib.nullcontext()
        with sampling:
            went = time.monotonic()
            workers.go()
            results = workers.results(settings.load_s + 30)
    finally:
        workers.close()
    after = served_model.stats.snapshot()
    ok = sum(r["ok"] for r in results)
    errors = sum(r["errors"] for r in results)
    rate = sum(r["samples"] for r in results) / settings.load_s
    batches = after.execution_count - before.execution_count
    samples = after.inference_count - before.inference_count
    mean_batch = samples / batches if batches else 0.0
    latencies = sorted(itertools.chain.from_iterable(r["latencies_ms"] for r in results))
    p50 = latencies[len(latencies) // 2] if latencies else float("nan")
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else float("nan")
    first_error = next((r["first_error"] for r in results if r["first_error"]), "")
    ratio = rate / inprocess_amp if inprocess_amp else 0.0
    graphs = served_model.load_report.get("cuda_graphs_status", "off")
    result = (f"{rate:,.0f} samples/s = {ratio:.2f} x in-process; mean batch {mean_batch:.1f}; "
              f"p50 {p50:.1f} ms, p99 {p99:.1f} ms; {errors} errors"
              + (f" (first: {first_error})" if first_error else "")
              + (f"; graphs {graphs}" if graphs != "off" else ""))
    report.add("c", check, result, INFO if errors == 0 else ERROR, samples_per_s=rate,
               ratio_vs_inprocess=ratio, inprocess_samples_per_s=inprocess_amp, requests_ok=ok,
               errors=errors, mean_batch=mean_batch, p50_ms=p50, p99_ms=p99,
               first_error=first_error, graphs=graphs, load_processes=settings.processes,
               concurrency=settings.concurrency, samples_per_request=1,
               seconds=settings.load_s)
    if nvml is not None and not nvml.unavailable:
        text, figures = busy_summary(
            nvml.between(went + NVML_SETTLE_S, went + settings.load_s))
        report.add("e", f"{model.name} under gateway load", text, INFO, **figures)


class LoadWorkers:
    """Load-generator processes (the SDK's AsyncClient; no torch), started together by 'go'."""

    def __init__(self, address: str, model: ThroughputModel, settings: ThroughputSettings) -> None:
        per_process = max(1, settings.concurrency // settings.processes)
        self._lines: list[queue.SimpleQueue] = []
        self._procs: list[subprocess.Popen] = []
        self._stderr: list[Any] = []
        for index in range(settings.processes):
            job = {"address": address, "model": model.name, "input": "INPUT__0",
                   "dims": list(model.input_dims), "dtype": model.input_dtype,
                   "concurrency": per_process, "seconds": settings.load_s, "seed": index}
            errors = tempfile.TemporaryFile(mode="w+")
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--_load-worker", json.dumps(job)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, cwd=ROOT)
            with _children_lock:
                _children.append(proc)
            lines: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._pump, args=(proc, lines), daemon=True).start()
            self._procs.append(proc)
            self._lines.append(lines)
            self._stderr.append(errors)

    @staticmethod
    def _pump(proc: subprocess.Popen, lines: queue.SimpleQueue) -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def _expect(self, index: int, marker: str, deadline: float) -> str:
        while True:
            try:
                line = self._lines[index].get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"load worker {index} sent no {marker.strip()!r} in time") from None
            if line is None:
                self._procs[index].wait(5)
                self._stderr[index].seek(0)
                tail = (self._stderr[index].read().strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"load worker {index} exited "
                                   f"{self._procs[index].returncode}: {tail}")
            if line.startswith(marker):
                return line[len(marker):]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for index in range(len(self._procs)):
            self._expect(index, "LOAD_READY", deadline)

    def go(self) -> None:
        for proc in self._procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()

    def results(self, timeout_s: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        return [json.loads(self._expect(i, "LOAD_RESULT ", deadline))
                for i in range(len(self._procs))]

    def close(self) -> None:
        for proc, errors in zip(self._procs, self._stderr):
            with contextlib.suppress(Exception):
                proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            with _children_lock, contextlib.suppress(ValueError):
                _children.remove(proc)
            errors.close()


def load_worker_main(job_json: str) -> int:
    """Child of (c): ``concurrency`` requests in flight for ``seconds`` once 'go' arrives."""
    from clients import AsyncClient

    job = json.loads(job_json)
    rng = np.random.default_rng(job["seed"])
    array = random_array(rng, (1, *job["dims"]), job["dtype"])
    inputs = {job["input"]: array}

    async def main() -> dict[str, Any]:
        client = AsyncClient(job["address"], timeout_s=30.0)
        try:
            await client.infer(job["model"], inputs)  # opens the channel before the clock starts
            print("LOAD_READY", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            end = time.monotonic() + job["seconds"]
            tally = {"ok": 0, "samples": 0, "errors": 0, "first_error": "", "latencies_ms": []}

            async def one_stream() -> None:
                while (started := time.monotonic()) < end:
                    try:
                        await client.infer(job["model"], inputs)
                    except Exception as exc:
                        tally["errors"] += 1
                        tally["first_error"] = tally["first_error"] or _summary(exc, 120)
                        await asyncio.sleep(0.01)
                        continue
                    finished = time.monotonic()
                    if finished <= end:
                        tally["ok"] += 1
                        tally["samples"] += array.shape[0]
                        tally["latencies_ms"].append(round((finished - started) * 1e3, 3))

            await asyncio.gather(*(one_stream() for _ in range(job["concurrency"])))
            # Enough for p50/p99 without a megabyte-long result line.
            stride = max(1, len(tally["latencies_ms"]) // LATENCY_SAMPLES)
            tally["latencies_ms"] = tally["latencies_ms"][::stride]
            return tally
        finally:
            await client.close()

    print("LOAD_RESULT " + json.dumps(asyncio.run(main())), flush=True)
    return 0


# -- (d) host-to-device --------------------------------------------------------------------------


def section_h2d(report: Report, budget: Budget) -> None:
    """Per case, copies timed with CUDA events against the forward: what lands on the critical
    path when the batch's inputs cross PCIe after it closes (from pageable memory, as a
    one-process server's request bytes; from pinned memory, as the shared arena), and what
    staging leaves there: the device-to-device gather of rows already on the GPU."""
    import statistics

    import torch

    device = "cuda:0"
    copy_stream = torch.cuda.Stream(device)
    compute_stream = torch.cuda.Stream(device)
    rng = np.random.default_rng()
    for name, batch in H2D_CASES:
        shape, dtype = EXAMPLE_INPUTS[name]
        module = build_from_source(ROOT / "models" / name / "1" / "model.py", device)
        # As the assembler makes it: a tensor over a freshly concatenated (pageable) array.
        pageable = torch.from_numpy(random_array(rng, (batch, *shape), dtype))
        sources = {"pageable": pageable, "pinned": pageable.pin_memory(),
                   "staged": pageable.to(device)}
        slot = torch.empty_like(sources["staged"])  # the batch's buffer in the pool
        for precision in ("fp32", "fp16"):
            check = f"{name} b{batch} {precision}"
            if budget.over():
                report.add("d", check, "not run: over the section's budget", SKIP)
                continue
            timings: dict[str, list[tuple[float, float]]] = {k: [] for k in sources}
            for source_name, source in sources.items():
                for repeat in range(H2D_WARMUP + H2D_REPEATS):
                    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                    with torch.cuda.stream(copy_stream):
                        events[0].record()
                        slot.copy_(source, non_blocking=True)
                        events[1].record()
                    compute_stream.wait_event(events[1])
                    with torch.cuda.stream(compute_stream), torch.inference_mode(), \
                            autocast_for(precision, device):
                        events[2].record()
                        module(slot)
                        events[3].record()
                    torch.cuda.synchronize()
                    if repeat >= H2D_WARMUP:
                        timings[source_name].append((events[0].elapsed_time(events[1]),
                                                     events[2].elapsed_time(events[3])))
            forward_ms = statistics.median(f for runs in timings.values() for _, f in runs)
            copy = {k: statistics.median(c for c, _ in runs) for k, runs in timings.items()}
            share = {k: ms / (ms + forward_ms) for k, ms in copy.items()}
            report.add(
                "d", check,
                f"forward {forward_ms * 1e3:.0f} us; on the critical path: pageable copy "
                f"{copy['pageable'] * 1e3:.0f} us ({share['pageable']:.0%}), pinned "
                f"{copy['pinned'] * 1e3:.0f} us ({share['pinned']:.0%}), with staging only the "
                f"gather {copy['staged'] * 1e3:.0f} us ({share['staged']:.1%}; target <= 5 %)",
                INFO, bytes=int(pageable.numel() * pageable.element_size()),
                copy_ms=copy["pageable"], pinned_copy_ms=copy["pinned"],
                staged_gather_ms=copy["staged"], forward_ms=forward_ms,
                copy_share=share["pageable"], pinned_copy_share=share["pinned"],
                staged_share=share["staged"])


def section_gather(report: Report, budget: Budget) -> None:
    """The gather as the executor does it: GATHER_REQUESTS single-sample requests of a
    ResNet-sized input assembled into a batch (``Executor._assemble``), from the request's own
    pageable bytes (one-process mode) and after staging while queued; the assembly's time on
    the critical path against a ResNet-50-sized forward. Then the shared arena pinned, as the
    executor process pins it (multi-process mode), and what pinning costs."""
    import torch

    from batcher.arena import SharedArena
    from batcher.metrics import BatcherMetrics
    from batcher.model import ServedModel
    from batcher.request import InferenceRequest
    from batcher.spec import BatchingConfig, ModelSpec, TensorSpec
    from prometheus_client import CollectorRegistry

    device = "cuda:0"
    if torchvision_problem():
        module: Any = torch.nn.Sequential(
            torch.nn.Conv2d(3, 64, 7, stride=2), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(64, 1000))
        forward = "conv stem (torchvision absent)"
    else:
        import torchvision

        module = torchvision.models.resnet50(weights=None)
        forward = "ResNet-50"
    module = module.eval().to(device)
    rng = np.random.default_rng()
    for staging in ("batch", "queue"):
        check = f"gather {GATHER_REQUESTS} x 1 sample {'x'.join(map(str, GATHER_INPUT))}, " \
                f"staged at {staging}"
        if budget.over():
            report.add("d", check, "not run: over the section's budget", SKIP)
            continue
        spec = ModelSpec(name="gather", version="1", platform="test", device=device,
                         inputs=(TensorSpec("x", "FP32", GATHER_INPUT),),
                         outputs=(TensorSpec("y", "FP32", (1000,)),),
                         batching=BatchingConfig(max_batch_size=GATHER_REQUESTS,
                                                 max_queue_delay_us=200_000),
                         buckets=(GATHER_REQUESTS,), input_staging=staging,
                         precision="amp-fp16")
        served = ServedModel(spec, module, metrics=BatcherMetrics(CollectorRegistry()))
        served.start()
        try:
            async def batches() -> None:
                for _ in range(GATHER_BATCHES):
                    await asyncio.gather(*(
                        served.infer(InferenceRequest(
                            [rng.standard_normal((1, *GATHER_INPUT), dtype=np.float32)]))
                        for _ in range(GATHER_REQUESTS)))

            before = served.stats.snapshot()
            asyncio.run(batches())
            after = served.stats.snapshot()
        finally:
            served.stop(5.0)
        runs = after.execution_count - before.execution_count
        # Triton's statistics add a batch's durations once per request in it.
        counted = max(after.compute_input.count - before.compute_input.count, 1)
        input_ms = (after.compute_input.ns - before.compute_input.ns) / 1e6 / counted
        infer_ms = (after.compute_infer.ns - before.compute_infer.ns) / 1e6 / counted
        share = input_ms / (input_ms + infer_ms) if input_ms + infer_ms else 0.0
        report.add("d", check,
                   f"assembly {input_ms:.2f} ms vs {forward} amp-fp16 {infer_ms:.2f} ms a "
                   f"batch over {runs} batches: {share:.1%} on the critical path (target "
                   "<= 5 %)", INFO, input_ms=input_ms, infer_ms=infer_ms, share=share,
                   batches=runs, staging=staging)
    arena = SharedArena.create(ARENA_PIN_BYTES)
    try:
        from server.executor_process import pin_arena

        started = time.perf_counter()
        pinned = pin_arena(arena, BatcherMetrics(CollectorRegistry()))
        seconds = time.perf_counter() - started
        report.add("d", f"arena pinned ({ARENA_PIN_BYTES >> 20} MiB)",
                   (f"pinned in {seconds * 1e3:.0f} ms (the whole arena is locked in RAM)"
                    if pinned else "pinning failed: the server falls back to unpinned"),
                   INFO if pinned else FAIL, pinned=pinned, seconds=seconds)
    finally:
        arena.close()


def section_pytest(report: Report, budget: Budget) -> None:
    """``pytest -m cuda`` on this machine, within the section's budget."""
    if importlib.util.find_spec("pytest") is None:
        report.add("t", "pytest -m cuda", "pytest is not installed here (carry its wheels)", SKIP)
        return
    timeout = budget.left()
    # The test that runs this script is left out: it would run this section again.
    # Only the files that hold cuda tests: the others need packages the machine may lack.
    files = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                   if "mark.cuda" in path.read_text())
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
               "--deselect", "tests/test_gpu_check.py::test_full_run_on_cuda", *files]
    try:
        out = run_child(command, env=dict(os.environ), timeout_s=timeout)
    except subprocess.TimeoutExpired:
        report.add("t", "pytest -m cuda", f"ran past {timeout:.0f} s", ERROR)
        return
    lines = [line for line in out.stdout.strip().splitlines() if line.strip()]
    summary = lines[-1] if lines else "no output"
    report.add("t", "pytest -m cuda", summary,
               PASS if out.returncode == 0 else FAIL, returncode=out.returncode,
               tail=lines[-30:])


# -- the run -------------------------------------------------------------------------------------


def finish(report: Report, json_path: Path | None, exit_code: int) -> int:
    say("")
    print_machine(report)
    say(report.table())
    say(f"gpu_check: {report.elapsed():.0f} s, exit {exit_code}"
        + (" (a correctness check failed or did not run)" if exit_code == 1 else ""))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report.to_json(exit_code), indent=2, default=str))
    return exit_code


def start_watchdog(report: Report, json_path: Path | None) -> None:
    """At HARD_LIMIT_S: stacks to stderr, then the table so far, then exit 3 (children too)."""

    def fire() -> None:
        time.sleep(max(0.0, HARD_LIMIT_S - report.elapsed()))
        sys.stderr.write(f"gpu_check: watchdog: {HARD_LIMIT_S:.0f} s passed; stacks:\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        with _children_lock:
            for proc in _children:
                with contextlib.suppress(Exception):
                    proc.kill()
        report.add("run", "watchdog", f"the run passed {HARD_LIMIT_S:.0f} s and was stopped", ERROR)
        with contextlib.suppress(Exception):
            finish(report, json_path, 3)
        sys.stdout.flush()
        os._exit(3)

    threading.Thread(target=fire, name="watchdog", daemon=True).start()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Check and measure batchgate's GPU paths (see the module docstring).")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every figure here")
    parser.add_argument("--cpu", action="store_true",
                        help="run section (a) on the CPU (fp32, amp-bf16, staging) to test the "
                             "harness, and (b)'s trace through our pool")
    parser.add_argument("--sections", default=None,
                        help="comma-separated subset of a,b,c,d,e (default: all; with --cpu: "
                             "a,b)")
    parser.add_argument("--models", default=",".join(EXAMPLE_MODELS),
                        help="example models for section (a)")
    parser.add_argument("--_alloc-replay", dest="alloc_replay", action="store_true",
                        help=argparse.SUPPRESS)
    parser.add_argument("--_load-worker", dest="load_worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_server-trace", dest="server_trace", default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--no-pytest", dest="pytest", action="store_false",
                        help="on a GPU, do not run `pytest -m cuda` at the end")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.load_worker is not None:
        return load_worker_main(args.load_worker)
    if args.alloc_replay:
        return alloc_replay_main()
    if args.server_trace is not None:
        ensure_structlog()
        return server_trace_main(args.server_trace)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu:
        say(f"gpu_check: no GPU present (torch {torch.__version__}: torch.cuda.is_available() "
            "is False); every GPU figure is unmeasured. `--cpu` tests the harness on the CPU.")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"cuda": False, "torch": torch.__version__}))
        return 0

    device = "cpu" if args.cpu else "cuda:0"
    sections = set((args.sections or ("a,b" if args.cpu else "a,b,c,d,e")).split(","))
    unknown = sections - set("abcde")
    if unknown:
        raise SystemExit(f"--sections takes letters among a,b,c,d,e, got {sorted(unknown)}")
    models = [m for m in args.models.split(",") if m]

    report = Report()
    start_watchdog(report, args.json)
    report.machine = machine_facts(device)
    report.machine["structlog_note"] = ensure_structlog()
    report.machine["imports"] = project_imports()
    report.machine["device"] = device
    print_machine(report)

    variants = CPU_VARIANTS if args.cpu else GPU_VARIANTS
    if "a" in sections:
        run_section(report, "a", A_BUDGET_S,
                    lambda r, b: section_correctness(r, b, device, variants, models))
    if "d" in sections:
        if args.cpu:
            report.add("d", "section", "needs a CUDA device", SKIP)
        else:
            run_section(report, "d", D_BUDGET_S,
                        lambda r, b: (section_h2d(r, b), section_gather(r, b)))
    if "b" in sections:
        run_section(report, "b", B_BUDGET_S, lambda r, b: section_memory(r, b, device))
    if sections & {"c", "e"}:
        settings = CPU_THROUGHPUT if args.cpu else GPU_THROUGHPUT
        run_section(report, "c", C_BUDGET_S, lambda r, b: section_throughput(r, b, settings))
    if cuda and not args.cpu and args.pytest:
        run_section(report, "t", T_BUDGET_S, section_pytest)
    return finish(report, args.json, 1 if report.correctness_failed() else 0)


if __name__ == "__main__":
    sys.exit(main())
