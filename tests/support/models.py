"""The tests' own models, written beside the example models into one repository by
``write_test_repository``: ``gated`` (y = 2x, can be held by a ``Gate`` so queues can be
observed), ``failing`` (raises on the value 13), ``wrongbatch`` (drops the batch dimension),
``hanging``, ``fatal``, ``echo`` (every numeric datatype), ``strlen`` and ``strings`` (BYTES in
and out), ``spare``; and ``reference``, an example model's own output computed here."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from batchgate.protos.model_config_pb2 import ModelConfig
from batchgate.bench.harness.repository import (model_config, renamed, tensor, with_parameters,
                                                write_model)
from tests.support import EXAMPLE_MODELS
from tests.support.polling import poll

def xy_config(name: str, *, max_batch_size: int = 8, dynamic=None, kind: str | None = "KIND_CPU",
              parameters=None) -> ModelConfig:
    """``name`` with one FP32 [2] input INPUT__0 and output OUTPUT__0 (the tests' usual
    shape), one instance of ``kind`` (None: no instance_group), no queue delay unless
    ``dynamic`` says otherwise; ``parameters`` as ``model_config`` takes them."""
    extra = {"instance_group": [{"kind": kind, "count": 1}]} if kind else {}
    return model_config(
        name, max_batch_size=max_batch_size, input=[tensor("INPUT__0", "FP32", [2])],
        output=[tensor("OUTPUT__0", "FP32", [2])],
        dynamic_batching=dynamic or {"max_queue_delay_microseconds": 0},
        parameters=parameters, **extra)


# GATE_DIR: the gate's folder, filled in by write_test_repository.
GATED_CONFIG = xy_config("gated", dynamic={
    "max_queue_delay_microseconds": 0, "priority_levels": 2, "default_priority_level": 2,
    "default_queue_policy": {"max_queue_size": 16}},
    parameters={"max_inflight_batches": "1", "warmup": "false", "gate_dir": "GATE_DIR"})

GATED_MODEL = '''
import time
from pathlib import Path

import torch


class Gated(torch.nn.Module):
    """y = 2x. Files in ``gate_dir`` drive it from another process: while ``closed`` exists each
    batch waits; ``entered`` appears when a batch starts; ``seen`` logs each row's first value."""

    def __init__(self, gate_dir):
        super().__init__()
        self.dir = Path(gate_dir)

    def forward(self, x):
        with open(self.dir / "seen", "a") as log:
            log.write("".join(f"{v}\\n" for v in x[:, 0].tolist()))
        (self.dir / "entered").touch()
        deadline = time.monotonic() + 30
        while (self.dir / "closed").exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        return x * 2


def build_model(parameters):
    return Gated(parameters["gate_dir"])
'''

FAILING_CONFIG = xy_config("failing")

FAILING_MODEL = '''
import torch


class Failing(torch.nn.Module):
    def forward(self, x):
        if bool((x == 13).any()):
            raise ValueError("secret internal detail")
        return x + 1


def build_model(parameters):
    return Failing()
'''

# wrongbatch would fail its warm-up; it must load so that the server can report the error.
WRONGBATCH_CONFIG = xy_config("wrongbatch", parameters={"warmup": "false"})
WRONGBATCH_MODEL = '''
import torch


class WrongBatch(torch.nn.Module):
    def forward(self, x):
        return x[:1]


def build_model(parameters):
    return WrongBatch()
'''

# A batch holding a 7 hangs until the file "unhang" appears in the gate folder (at most 120 s);
# a 1-second execution timeout fails it first. Two batches in flight (one is the CPU default):
# the timeout must also work with the assembler/compute thread pair.
HANGING_CONFIG = xy_config("hanging", parameters={
    "max_inflight_batches": "2", "execution_timeout_ms": "1000", "gate_dir": "GATE_DIR"})
HANGING_MODEL = '''
import time
from pathlib import Path

import torch


class Hanging(torch.nn.Module):
    def __init__(self, gate_dir):
        super().__init__()
        self.unhang = Path(gate_dir) / "unhang"

    def forward(self, x):
        if bool((x == 7).any()):
            deadline = time.monotonic() + 120
            while not self.unhang.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        return x + 1


def build_model(parameters):
    return Hanging(parameters["gate_dir"])
'''

# A batch holding a 13 raises SystemExit, which no model should: the instance stops for good.
FATAL_CONFIG = xy_config("fatal")
FATAL_MODEL = '''
import torch


class Fatal(torch.nn.Module):
    def forward(self, x):
        if bool((x == 13).any()):
            raise SystemExit(3)
        return x + 1


def build_model(parameters):
    return Fatal()
'''

NUMERIC_TYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                 "INT64", "FP16", "FP32", "FP64", "BF16")
ECHO_CONFIG = model_config(
    "echo", max_batch_size=4, input=[tensor(f"IN_{t}", t, [3]) for t in NUMERIC_TYPES],
    output=[tensor(f"OUT_{t}", t, [3]) for t in NUMERIC_TYPES],
    dynamic_batching={"max_queue_delay_microseconds": 1000})
ECHO_MODEL = """
import torch


class Echo(torch.nn.Module):
    \"\"\"Returns every input unchanged: the codec's round trip for each datatype.\"\"\"

    def forward(self, *inputs):
        return tuple(t.clone() for t in inputs)


def build_model(parameters):
    return Echo()
"""

STRLEN_CONFIG = model_config(
    "strlen", max_batch_size=8, input=[tensor("TEXT", "BYTES", [1])],
    output=[tensor("LENGTH", "INT64", [1])], dynamic_batching={"max_queue_delay_microseconds": 0})
STRLEN_MODEL = '''
import numpy as np
import torch


class StrLen(torch.nn.Module):
    """BYTES in: the module gets the numpy object array of the batch; returns byte lengths."""

    def forward(self, text):
        return torch.from_numpy(np.vectorize(len, otypes=[np.int64])(text))


def build_model(parameters):
    return StrLen()
'''

# BYTES in and out. A batch is released when it holds 4 rows (the long delay makes requests of
# fewer rows wait for each other, so one batch is split per request). A batch whose first element
# names a fault returns that fault instead, which must fail the batch.
STRINGS_CONFIG = model_config(
    "strings", max_batch_size=4, input=[tensor("TEXT", "BYTES", [2])],
    output=[tensor("UPPER", "BYTES", [2]), tensor("SWAPPED", "BYTES", [2]),
            tensor("JOINED", "BYTES", [1]), tensor("LENGTH", "INT64", [2])],
    dynamic_batching={"max_queue_delay_microseconds": 10000000})
STRINGS_MODEL = '''
import numpy as np
import torch


class Strings(torch.nn.Module):
    """UPPER: a numpy object array; SWAPPED: a list of rows, each a list of bytes; JOINED: a
    list of str, one per row (sent as UTF-8); LENGTH: a tensor of byte lengths."""

    def forward(self, text):
        upper = np.vectorize(bytes.upper, otypes=[object])(text)
        swapped = [[row[1], row[0]] for row in text]
        joined = [b"+".join(row).decode("latin-1") + "\u00e9" for row in text]
        length = torch.from_numpy(np.vectorize(len, otypes=[np.int64])(text))
        fault = text[0, 0]
        if fault == b"int":
            upper[-1, 1] = 7
        elif fault == b"float":
            upper = torch.zeros(text.shape)
        elif fault == b"short":
            joined = joined[1:]
        elif fault == b"unbatched":
            swapped = upper.reshape(-1)
        elif fault == b"object":
            length = length.numpy().astype(object)
        return upper, swapped, joined, length


def build_model(parameters):
    return Strings()
'''

TEST_MODELS = {
    "echo": (ECHO_CONFIG, ECHO_MODEL),
    "strlen": (STRLEN_CONFIG, STRLEN_MODEL),
    "strings": (STRINGS_CONFIG, STRINGS_MODEL),
    "spare": (renamed(FAILING_CONFIG, "spare"), FAILING_MODEL),
    "gated": (GATED_CONFIG, GATED_MODEL),
    "failing": (FAILING_CONFIG, FAILING_MODEL),
    "wrongbatch": (WRONGBATCH_CONFIG, WRONGBATCH_MODEL),
    "hanging": (HANGING_CONFIG, HANGING_MODEL),
    "fatal": (FATAL_CONFIG, FATAL_MODEL),
}


def write_test_repository(root: Path, gate_dir: Path) -> Path:
    """The example models and ``TEST_MODELS`` in ``root``; models that take a gate get
    ``gate_dir``."""
    for child in EXAMPLE_MODELS.iterdir():
        if child.is_dir() and (child / "config.pbtxt").exists():
            shutil.copytree(child, root / child.name, ignore=shutil.ignore_patterns("__pycache__"))
    for config, model in TEST_MODELS.values():
        if "gate_dir" in config.parameters:
            config = with_parameters(config, gate_dir=gate_dir)
        write_model(root, config, model)
    return root


class Gate:
    """Drives the ``gated`` test model through files, so it works across processes."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def close(self) -> None:
        (self.dir / "entered").unlink(missing_ok=True)
        (self.dir / "seen").unlink(missing_ok=True)
        (self.dir / "closed").touch()

    def open(self) -> None:
        (self.dir / "closed").unlink(missing_ok=True)

    def wait_entered(self, timeout_s: float = 30) -> None:
        poll(lambda: (self.dir / "entered").exists(), timeout_s, "the gated model never ran")

    def seen(self) -> list[float]:
        path = self.dir / "seen"
        return [float(v) for v in path.read_text().split()] if path.exists() else []


_REFERENCE_MODULES: dict[str, object] = {}


def reference(model: str, x: np.ndarray) -> np.ndarray:
    """The example model's own output on ``x`` alone, computed in this process (seeded weights)."""
    module = _REFERENCE_MODULES.get(model)
    if module is None:
        from batchgate.batcher.loading import latest_version, load_module

        version = latest_version(EXAMPLE_MODELS / model)
        module = _REFERENCE_MODULES[model] = load_module(
            version, filename=None, parameters={}, device="cpu")
    with torch.inference_mode():
        return module(torch.from_numpy(np.ascontiguousarray(x))).numpy()
