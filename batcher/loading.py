"""Turn the artifact in a model's version folder into an ``nn.Module`` on its device.

A version folder (``<repository>/<model>/<version>/``) holds one of these, looked up in this
order unless ``config.pbtxt`` names the file with ``default_model_filename``:

``model.pt``
    TorchScript (``torch.jit.save``), the artifact of Triton's PyTorch backend. Loaded with
    ``torch.jit.load(path, map_location=device)``.
``model.pt2``
    An exported program (``torch.export.save``). Loaded with ``torch.export.load(path).module()``
    and moved to the device. An exported program keeps the train/eval behaviour it was exported
    with, so export it from a module in eval mode.
``model.py``
    Python source that builds the module. The contract:

    - the file defines ``build_model(parameters: Mapping[str, str]) -> torch.nn.Module``;
    - ``parameters`` are the model's ``config.pbtxt`` parameters (key -> ``string_value``),
      batchgate's own keys included, so a model can read settings of its own from there;
    - the module it returns takes the model's inputs as positional tensors, in the order of
      ``config.pbtxt``'s ``input`` list, and returns one tensor or a tuple of tensors in the
      order of the ``output`` list; BYTES inputs arrive as numpy object arrays of ``bytes``,
      and a BYTES output is a numpy object/``bytes_``/``str_`` array or a list with one entry
      per row (``batchgate.batcher.tensors.bytes_tensor``); only a ``model.py`` can have BYTES outputs;
    - build it on the CPU; the loader moves it to the model's device and puts it in eval mode;
    - seed any random weights locally (``torch.random.fork_rng`` or a ``torch.Generator``):
      several models are built in one process.

    Each file is imported under a module name of its own (``batchgate_model_<n>``), so two
    models' ``model.py`` never collide, and reloading a model imports its file afresh. Builders
    run one at a time: a builder that seeds torch's global generator inside ``fork_rng`` would
    otherwise race another builder's draws. ``torch.jit.trace`` is welcome there (a traced
    module releases the GIL for its whole forward); its deprecation warning is silenced while
    the builder runs.

Every failure raises :class:`~batchgate.batcher.errors.LoadError` with a message that names the file and
says what went wrong; the traceback goes to the log, never into the message.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import re
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import structlog
import torch

from batchgate.batcher.errors import LoadError, exception_summary

log = structlog.get_logger(__name__)

ARTIFACT_FILENAMES = ("model.pt", "model.pt2", "model.py")

_module_numbers = itertools.count(1)
_load_lock = threading.Lock()


def cuda_available() -> bool:
    """Whether models can be placed on a CUDA device in this process (for ``server/``)."""
    return torch.cuda.is_available()


def find_artifact(version_dir: Path, filename: str | None = None) -> Path | None:
    """The artifact :func:`load_module` would load from ``version_dir``, or None."""
    candidates = (filename,) if filename else ARTIFACT_FILENAMES
    for name in candidates:
        path = version_dir / name
        if path.is_file():
            return path
    return None


# Version folders are positive integers without leading zeros, as in Triton.
_VERSION_FOLDER = re.compile(r"[1-9][0-9]*")


def latest_version(model_dir: Path, filename: str | None = None) -> Path:
    """The highest-numbered version folder of ``model_dir`` that holds a model artifact."""
    versions = sorted(
        (int(entry.name), entry)
        for entry in model_dir.iterdir()
        if entry.is_dir() and _VERSION_FOLDER.fullmatch(entry.name)
    )
    for _, folder in reversed(versions):
        if find_artifact(folder, filename) is not None:
            return folder
    wanted = filename or ", ".join(ARTIFACT_FILENAMES)
    raise LoadError(f"model {model_dir.name!r}: no version folder under {model_dir} holds {wanted}")


def load_module(
    version_dir: Path,
    *,
    filename: str | None,
    parameters: Mapping[str, str],
    device: str,
    bytes_outputs: Sequence[str] = (),
) -> torch.nn.Module:
    """Load the model artifact in ``version_dir``, in eval mode, on ``device``.

    ``bytes_outputs``: the outputs the config declares BYTES. Only a ``model.py`` can return
    them (torch has no string tensor), so any other artifact is refused before it is loaded.
    """
    path = find_artifact(version_dir, filename)
    if path is None:
        wanted = filename or " or ".join(ARTIFACT_FILENAMES)
        raise LoadError(f"{version_dir}: no model artifact ({wanted}) in the version folder")
    if bytes_outputs and path.suffix != ".py":
        kind = "an exported program" if path.suffix == ".pt2" else "TorchScript"
        names = ", ".join(repr(name) for name in bytes_outputs)
        which = f"output {names} is" if len(bytes_outputs) == 1 else f"outputs {names} are"
        raise LoadError(f"{path}: {path.name} is {kind}, which cannot return BYTES: {which} "
                        "declared TYPE_STRING; serve this model from a model.py")
    if path.suffix == ".pt2":
        module = _load_exported(path, device)
    elif path.suffix == ".py":
        module = _load_python(path, parameters, device)
    else:
        # Triton's PyTorch backend accepts any default_model_filename as TorchScript.
        module = _load_torchscript(path, device)
    log.debug("model_artifact_loaded", path=str(path), kind=type(module).__name__, device=device)
    return module


def _load_torchscript(path: Path, device: str) -> torch.nn.Module:
    try:
        with _quiet_torchscript():
            module = torch.jit.load(str(path), map_location=device)
    except Exception as exc:
        raise _load_error(path, "cannot load it as TorchScript (torch.jit.load)", exc) from exc
    return module.eval()


def _load_exported(path: Path, device: str) -> torch.nn.Module:
    try:
        module = torch.export.load(str(path)).module()
    except Exception as exc:
        what = "cannot load it as an exported program (torch.export.load)"
        raise _load_error(path, what, exc) from exc
    # An exported module refuses .eval(): its train/eval behaviour was fixed at export time.
    return _to_device(module, path, device)


def _load_python(path: Path, parameters: Mapping[str, str], device: str) -> torch.nn.Module:
    module_name = f"batchgate_model_{next(_module_numbers)}"
    try:
        import_spec = importlib.util.spec_from_file_location(module_name, path)
        if import_spec is None or import_spec.loader is None:
            raise LoadError(f"{path}: cannot be imported as a Python module")
        source = importlib.util.module_from_spec(import_spec)
        # Registered so that dataclasses, pickling and torch.jit.script can find the module.
        sys.modules[module_name] = source
        import_spec.loader.exec_module(source)
    except LoadError:
        sys.modules.pop(module_name, None)
        raise
    except (Exception, SystemExit) as exc:
        sys.modules.pop(module_name, None)
        raise _load_error(path, "importing it raised", exc) from exc

    build_model = getattr(source, "build_model", None)
    if not callable(build_model):
        raise LoadError(
            f"{path}: defines no build_model(parameters) function; "
            "a model.py must define build_model(parameters) -> torch.nn.Module"
        )
    try:
        with _quiet_torchscript():
            module = build_model(dict(parameters))
    except (Exception, SystemExit) as exc:
        raise _load_error(path, "build_model(parameters) raised", exc) from exc
    if not isinstance(module, torch.nn.Module):
        raise LoadError(
            f"{path}: build_model(parameters) must return a torch.nn.Module, "
            f"got {type(module).__name__}"
        )
    module = _to_device(module, path, device)
    return module.eval()


@contextlib.contextmanager
def _quiet_torchscript() -> Iterator[None]:
    """Serialise loads and silence torch's TorchScript deprecation warnings meanwhile.

    TorchScript is the artifact format of Triton's PyTorch backend, and a traced module runs
    its forward without the GIL: the warning is not something a server operator can act on.
    The lock also makes the (process-global) warning filter change safe between loads.
    """
    with _load_lock, warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.", category=DeprecationWarning
        )
        yield


def _to_device(module: torch.nn.Module, path: Path, device: str) -> torch.nn.Module:
    try:
        return module.to(device)
    except Exception as exc:
        raise _load_error(path, f"cannot move the model to {device}", exc) from exc


def _load_error(path: Path, what: str, exc: BaseException) -> LoadError:
    log.error("model_artifact_failed", path=str(path), error=what, exc_info=exc)
    return LoadError(f"{path}: {what}: {exception_summary(exc)}")
