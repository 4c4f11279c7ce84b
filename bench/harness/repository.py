"""Model repositories written from a ``ModelConfig``: the one way tests and benchmarks make a
model folder, so every config.pbtxt they write is one the protobuf text format produced.

    write_model(root, model_config("double", max_batch_size=8,
                                   input=[tensor("INPUT__0", "FP32", [2])],
                                   output=[tensor("OUTPUT__0", "FP32", [2])],
                                   parameters={"warmup": "false"}),
                MODEL_SOURCE)

(Tests of the config parser itself write their text by hand.)
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from batchgate.protos.model_config_pb2 import ModelConfig


def tensor(name: str, datatype: str, dims: Sequence[int], **fields: Any) -> dict[str, Any]:
    """A ``ModelInput``/``ModelOutput`` as keyword arguments; ``datatype`` in the wire's names
    ("FP32", "BYTES") or the config's ("TYPE_FP32", "TYPE_STRING")."""
    if not datatype.startswith("TYPE_"):
        datatype = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
    return {"name": name, "data_type": datatype, "dims": list(dims), **fields}


def model_config(name: str, *, parameters: Mapping[str, object] | None = None,
                 **fields: Any) -> ModelConfig:
    """A ``ModelConfig`` named ``name``: ``fields`` as ``ModelConfig``'s constructor takes them
    (nested messages as dicts, enums by name); ``parameters`` as plain values (each becomes its
    ``string_value``), ``backend`` "pytorch" unless given."""
    fields.setdefault("backend", "pytorch")
    config = ModelConfig(name=name, **fields)
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value)
    return config


def with_parameters(config: ModelConfig, **parameters: object) -> ModelConfig:
    """A copy of ``config`` with ``parameters`` added (or replaced)."""
    copy = ModelConfig()
    copy.CopyFrom(config)
    for key, value in parameters.items():
        copy.parameters[key].string_value = str(value)
    return copy


def renamed(config: ModelConfig, name: str) -> ModelConfig:
    """A copy of ``config`` named ``name``."""
    copy = ModelConfig()
    copy.CopyFrom(config)
    copy.name = name
    return copy


def config_text(config: ModelConfig) -> str:
    """``config`` in the protobuf text format, as config.pbtxt holds it."""
    return text_format.MessageToString(config)


def read_config(folder: Path) -> ModelConfig:
    """``folder``/config.pbtxt as a ``ModelConfig``."""
    return text_format.Parse((folder / "config.pbtxt").read_text(encoding="utf-8"), ModelConfig())


def write_config(folder: Path, config: ModelConfig) -> Path:
    """``folder``/config.pbtxt from ``config``; the folder is made if need be."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.pbtxt"
    path.write_text(config_text(config), encoding="utf-8")
    return path


def write_model(root: Path, config: ModelConfig, source: str | bytes | None = None, *,
                filename: str = "model.py", version: int | str = 1,
                folder: str | None = None) -> Path:
    """``root``/NAME/config.pbtxt from ``config`` and, if ``source`` is given,
    ``root``/NAME/``version``/``filename`` holding it; NAME is ``folder`` or the config's name.
    Returns the model's folder."""
    model = root / (folder or config.name)
    write_config(model, config)
    if source is not None:
        (model / str(version)).mkdir(parents=True, exist_ok=True)
        path = model / str(version) / filename
        if isinstance(source, bytes):
            path.write_bytes(source)
        else:
            path.write_text(source, encoding="utf-8")
    return model


def copy_model(source: Path, root: Path, name: str | None = None,
               parameters: Mapping[str, object] | None = None) -> Path:
    """The model folder ``source`` (an example model, say) copied to ``root``/``name`` (default:
    its own name), its config renamed to match and ``parameters`` added or replaced. Returns
    the new folder."""
    target = root / (name or source.name)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = read_config(source)
    if name is not None:
        config.name = name
    write_config(target, with_parameters(config, **(parameters or {})))
    return target
