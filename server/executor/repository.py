"""ModelRepository: the lifecycle of the models in a Triton-style model repository.

``<root>/<model>/config.pbtxt`` plus numbered version folders ``<root>/<model>/<n>/``. The
latest version is served: the highest-numbered folder that holds a model artifact (folder names
that are not numbers, or that start with 0, are ignored, as in Triton).

Each model moves through ``UNAVAILABLE -> LOADING -> READY -> UNLOADING -> UNAVAILABLE``. The
blocking part of a load (reading the config, building the module, warming it up) runs in a
worker thread, and the model answers requests only once its warm-up is done. Reloading a READY
model builds the new version beside the old one, swaps, then drains and stops the old one: the
old version keeps serving until the swap, and keeps serving if the new version fails to load.

A load may bring its own config and files (a ``LoadOverride``, ``server/executor/load_override.py``):
the config replaces ``config.pbtxt`` for that load; files replace the whole model folder, and are
written into a private temporary folder (never into the root), which is removed when that
version stops being served (unloaded, replaced, failed) and when the repository closes. A load
that fails, for whatever reason, leaves the version served before serving.

A model name from a client is only ever a folder directly under the root: names with a path
separator, NUL, a leading dot (``.``, ``..``, hidden folders), or longer than a file name may be
are refused. Every file-system lookup a name causes goes through ``_model_dir``, which checks it
first. What the operator put in the root is trusted: a model folder that is a symbolic link is
followed wherever it leads (model stores and volume mounts are laid out that way, and whoever
can write a link into the root could as well write a ``model.py``).

This module knows nothing of gRPC: it raises the ``batchgate.batcher.errors`` hierarchy, and calls
``on_state_change(name, state)`` on every state change so the server can mirror it elsewhere
(per-model health service names). State is only changed on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import structlog

from batchgate.batcher import gpu, loading
from batchgate.batcher.errors import (
    BatchgateError,
    InvalidRequest,
    LoadError,
    ModelNotFound,
    ModelUnavailable,
    ResourceExhausted,
    quoted,
)
from batchgate.batcher.delivery import Delivery
from batchgate.batcher.device import Devices
from batchgate.batcher.memory import DevicePools
from batchgate.batcher.model import ServedModel
from batchgate.batcher.spec import ModelSpec
from batchgate.protos import model_config_pb2
from batchgate.server.config import model_config
from batchgate.server.config import model_spec
from batchgate.server.rules import messages
from batchgate.server.executor.warmup import warmup_inputs
from batchgate.server.executor.load_override import MAX_NAME_BYTES, LoadOverride, as_sent, write_files

log = structlog.get_logger(__name__)

UNAVAILABLE = "UNAVAILABLE"
LOADING = "LOADING"
READY = "READY"
UNLOADING = "UNLOADING"
STATES = (UNAVAILABLE, LOADING, READY, UNLOADING)

# How long a version replaced by a reload may take to finish the requests queued on it.
RETIRE_DRAIN_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class ModelIndexEntry:
    """One row of the repository index (Triton's ``RepositoryIndexResponse.ModelIndex``)."""

    name: str
    version: str  # the version served, or last tried; "" when never loaded
    state: str  # one of STATES
    reason: str  # why the model is not READY ("" when it is)


@dataclasses.dataclass(frozen=True)
class _Loaded:
    model: ServedModel
    config: model_config_pb2.ModelConfig  # effective
    files: Path | None = None  # the private folder of a load's files, removed with the version

    @property
    def version(self) -> str:
        return self.model.spec.version

    def stop(self, drain_timeout_s: float) -> None:
        """Stop the model, then remove its files (blocking: a worker thread calls it)."""
        try:
            self.model.stop(drain_timeout_s)
        finally:
            if self.files is not None:
                shutil.rmtree(self.files, ignore_errors=True)


@dataclasses.dataclass
class _Slot:
    name: str
    state: str = UNAVAILABLE
    reason: str = "not loaded"
    version: str = ""
    loaded: _Loaded | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)


class ModelRepository:
    def __init__(
        self,
        root: Path,
        *,
        metrics=None,
        cuda_available: bool | None = None,
        on_state_change: Callable[[str, str], None] | None = None,
        pools: DevicePools | None = None,
        delivery: Delivery | None = None,
    ) -> None:
        """``pools``: the device memory pools models are admitted into (default: pools of the
        default size, strict). ``delivery``: where every model's answers go
        (``batcher/delivery.py``; default: the futures ``ServedModel.infer`` awaits)."""
        self._delivery = delivery
        self._root = Path(root)
        self._metrics = metrics
        self._pools = pools if pools is not None else DevicePools(metrics=metrics)
        # What the models on one device share: its pool and its weighted turns.
        self._devices = Devices(self._pools)
        self._cuda = loading.cuda_available() if cuda_available is None else cuda_available
        self._on_state_change = on_state_change
        self._slots: dict[str, _Slot] = {}
        self._closing = False
        self._background: set[asyncio.Task] = set()
        self._files_root: Path | None = None  # made at the first load that brings files

    @property
    def root(self) -> Path:
        return self._root

    # -- what is there -------------------------------------------------------------------------

    def index(self) -> list[ModelIndexEntry]:
        """Every model folder under the root, loaded or not, and every model still served."""
        for name in self._model_folders():
            self._slot(name)
        return [
            ModelIndexEntry(slot.name, slot.version, slot.state, slot.reason)
            for slot in sorted(self._slots.values(), key=lambda s: s.name)
        ]

    def loaded(self) -> list[ServedModel]:
        """The READY models, by name."""
        return [
            slot.loaded.model
            for slot in sorted(self._slots.values(), key=lambda s: s.name)
            if slot.state == READY and slot.loaded is not None
        ]

    def ready_models(self) -> list[str]:
        """The names of the READY models, sorted."""
        return [model.spec.name for model in self.loaded()]

    async def statistics(self, name: str = "", version: str = "") -> list[tuple]:
        """``(name, version, StatsSnapshot)`` of one model, or of every READY one."""
        models = [self.get(name, version)] if name else self.loaded()
        return [(m.spec.name, m.spec.version, m.stats.snapshot()) for m in models]

    def knows(self, name: str) -> bool:
        """Whether ``name`` is a model of this repository in any state (loaded or tried once):
        a name a metric may carry."""
        return name in self._slots

    def get(self, name: str, version: str = "") -> ServedModel:
        """The READY model serving ``name`` (at ``version``, when given)."""
        return self._loaded(name, version).model

    def config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        """The effective config of the READY model (what the ModelConfig RPC reports)."""
        return self._loaded(name, version).config

    def spec(self, name: str, version: str = "") -> ModelSpec:
        return self._loaded(name, version).model.spec

    def _loaded(self, name: str, version: str) -> _Loaded:
        slot = self._slots.get(name)
        if slot is None:
            model_dir = self._root / name
            if self._is_plain_name(name) and self._has_config(model_dir):
                raise ModelUnavailable(messages.MODEL_NOT_AVAILABLE(model=quoted(name),
                                                                     reason="not loaded"))
            raise ModelNotFound(messages.MODEL_UNKNOWN(model=quoted(name)))
        loaded = slot.loaded
        if slot.state != READY or loaded is None:
            raise ModelUnavailable(self._unavailable_message(slot))
        if version and version != loaded.version:
            raise ModelNotFound(messages.MODEL_NO_VERSION(
                model=quoted(name), version=quoted(version), serving=loaded.version))
        return loaded

    @staticmethod
    def _unavailable_message(slot: _Slot) -> str:
        if slot.state == LOADING:
            return f"model {quoted(slot.name)} is loading; retry when it is ready"
        if slot.state == UNLOADING:
            return f"model {quoted(slot.name)} is unloading and takes no new requests"
        return messages.MODEL_NOT_AVAILABLE(model=quoted(slot.name), reason=slot.reason)

    # -- lifecycle -----------------------------------------------------------------------------

    async def load_all(self) -> None:
        """Load every model folder; one that fails is logged and left UNAVAILABLE."""
        names = self._model_folders()
        log.info("repository_loading", repository=str(self._root), models=names)
        for name in names:
            try:
                await self.load(name)
            except BatchgateError:
                pass  # logged by load(); the model is UNAVAILABLE with the reason

    async def load(self, name: str, override: LoadOverride | None = None) -> None:
        """Load (or reload) the latest version of ``name``; READY once warmed up. ``override``:
        the config, and files, of this load instead of the repository's."""
        model_dir = self._model_dir(name)
        if self._closing:
            raise ModelUnavailable(f"the repository is closing; model {quoted(name)} was not loaded")
        override = override or LoadOverride()
        if override.config is not None and override.config.name not in ("", name):
            raise InvalidRequest(
                f"load parameter 'config': name must be the model's name {quoted(name)} or "
                f"empty, got {quoted(override.config.name)}")
        if override.files:
            pass  # the load's files are the whole model folder
        elif override.config is not None:
            if not self._is_folder(model_dir):
                raise ModelNotFound(
                    f"{messages.MODEL_UNKNOWN(model=quoted(name))}: no folder of that name in "
                    "the model repository (a load whose config replaces its config.pbtxt reads "
                    "the rest of the folder)")
        elif not self._has_config(model_dir):
            raise ModelNotFound(
                f"{messages.MODEL_UNKNOWN(model=quoted(name))}: no "
                f"{model_config.CONFIG_FILENAME} in its folder of the model repository")
        slot = self._slot(name)
        async with slot.lock:
            previous = slot.loaded if slot.state == READY else None
            if previous is None:
                self._set_state(slot, LOADING, "loading")
            log.info("model_loading", model=name, reloading=previous is not None,
                     config_override=override.config is not None,
                     files=len(override.files))
            try:
                loaded = await asyncio.to_thread(
                    self._build, model_dir, self._failure_reporter(name), override)
            except Exception as exc:
                # A model that does not fit its device's memory pool: RESOURCE_EXHAUSTED.
                known = isinstance(exc, (LoadError, ResourceExhausted))
                error = exc if known else self._unexpected(name, exc)
                log.error("model_load_failed", model=name, reason=str(error))
                if previous is not None:
                    # The old version keeps serving; the failure shows in the index.
                    slot.reason = f"reload failed: {error}"
                else:
                    self._set_state(slot, UNAVAILABLE, f"failed to load: {error}")
                if error is exc:
                    raise
                raise error from exc
            if self._closing:
                # close() is waiting for this lock to unload whatever is still served here.
                await asyncio.to_thread(loaded.stop, 0.0)
                if previous is None:
                    self._set_state(slot, UNAVAILABLE, "the repository closed while loading")
                raise ModelUnavailable(
                    f"the repository is closing; model {quoted(name)} was not loaded"
                )
            slot.loaded = loaded
            slot.version = loaded.version
            self._set_state(slot, READY, "", replaced=previous is not None)
            log.info("model_ready", model=name, version=loaded.version,
                     device=loaded.model.spec.device)
            if previous is not None:
                # Requests already queued on the old version finish there.
                await asyncio.to_thread(previous.stop, RETIRE_DRAIN_TIMEOUT_S)
                log.info("model_version_retired", model=name, version=previous.version)

    async def unload(self, name: str, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests for ``name``, let queued ones finish, stop it."""
        model_dir = self._model_dir(name)
        slot = self._slots.get(name)
        if slot is None:
            if not self._is_folder(model_dir):
                raise ModelNotFound(messages.MODEL_UNKNOWN(model=quoted(name)))
            return  # never loaded: nothing to do
        async with slot.lock:
            loaded = slot.loaded
            if loaded is None:
                return
            self._set_state(slot, UNLOADING, "unloading")
            log.info("model_unloading", model=name, version=loaded.version,
                     drain_timeout_s=drain_timeout_s)
            try:
                await asyncio.to_thread(loaded.stop, drain_timeout_s)
            finally:
                slot.loaded = None
                self._set_state(slot, UNAVAILABLE, "unloaded")
            log.info("model_unloaded", model=name, version=loaded.version)

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Unload every model, draining them together; no load is accepted afterwards."""
        self._closing = True
        names = [slot.name for slot in self._slots.values() if slot.loaded is not None]
        results = await asyncio.gather(
            *(self.unload(name, drain_timeout_s) for name in names), return_exceptions=True
        )
        for name, result in zip(names, results):
            if isinstance(result, BaseException):
                log.error("model_unload_failed", model=name, exc_info=result)
        if self._files_root is not None:
            shutil.rmtree(self._files_root, ignore_errors=True)

    # -- the blocking part of a load (worker thread) -------------------------------------------

    def _failure_reporter(self, name: str) -> Callable[[ServedModel, str], None]:
        """Called from an executor thread when a served model stops for good."""
        loop = asyncio.get_running_loop()

        def report(served: ServedModel, reason: str) -> None:
            def spawn() -> None:
                task = loop.create_task(self._model_failed(name, served, reason))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to report to
                loop.call_soon_threadsafe(spawn)

        return report

    async def _model_failed(self, name: str, served: ServedModel, reason: str) -> None:
        slot = self._slots.get(name)
        if slot is None:
            return
        async with slot.lock:
            loaded = slot.loaded
            if loaded is None or loaded.model is not served:
                return  # already unloaded or replaced
            slot.loaded = None
            log.error("model_failed", model=name, version=slot.version, reason=reason)
            self._set_state(slot, UNAVAILABLE, f"failed: {reason}; load it again to retry")
        await asyncio.to_thread(loaded.stop, 0.0)

    def _build(self, model_dir: Path,
               on_failed: Callable[[ServedModel, str], None] | None = None,
               override: LoadOverride | None = None) -> _Loaded:
        override = override or LoadOverride()
        if not override.files:
            return self._build_from(model_dir, on_failed, override.config)
        name = model_dir.name
        if self._files_root is None:
            self._files_root = Path(tempfile.mkdtemp(prefix="batchgate-load-files-"))
            # Also gone when the process exits without closing the repository.
            weakref.finalize(self, shutil.rmtree, self._files_root, ignore_errors=True)
        files = write_files(self._files_root, name, override.files)
        try:
            return self._build_from(files / name, on_failed, override.config, files)
        except LoadError as exc:
            shutil.rmtree(files, ignore_errors=True)
            raise LoadError(as_sent(str(exc), files / name)) from exc
        except BaseException:
            shutil.rmtree(files, ignore_errors=True)
            raise

    def _build_from(self, model_dir: Path, on_failed: Callable[[ServedModel, str], None] | None,
                    config_override: model_config_pb2.ModelConfig | None,
                    files: Path | None = None) -> _Loaded:
        name = model_dir.name
        if config_override is None:
            config, unsupported = model_config.read_model_config(model_dir)
            source = str(model_dir / model_config.CONFIG_FILENAME)
        else:
            config = model_config_pb2.ModelConfig()
            config.CopyFrom(config_override)
            config.name = name
            filename = config.default_model_filename
            # What the operator wrote may point anywhere; what a client sends stays in the folder.
            if filename and not self._is_plain_name(filename):
                raise LoadError(
                    "load parameter 'config': default_model_filename must be a file name in "
                    f"the version folder, got {quoted(filename)}")
            unsupported = model_config.unsupported_fields(config)
            source = "the load's config parameter"
        if unsupported:
            log.warning("config_fields_not_supported", model=name, fields=unsupported,
                        config=source)
        filename = config.default_model_filename or None
        version_dir = loading.latest_version(model_dir, filename)
        try:
            spec = model_spec.model_spec_from_config(
                config, version_dir.name, cuda_available=self._cuda
            )
        except LoadError as exc:
            if config_override is None:
                raise
            raise LoadError(f"{exc} (the load's config parameter stands for the whole "
                            f"{model_config.CONFIG_FILENAME})") from None
        warmup = warmup_inputs(config, spec, model_dir)
        parameters = {key: value.string_value for key, value in config.parameters.items()}
        # On a GPU the model's weights come from its own allocator pool (batcher/gpu.py).
        memory = gpu.ModelMemory(spec.device, name)
        try:
            with memory.use():
                module = loading.load_module(
                    version_dir, filename=filename, parameters=parameters, device=spec.device,
                    bytes_outputs=[o.name for o in spec.outputs if o.datatype == "BYTES"],
                )
        except BaseException:
            memory.close()
            raise
        served = ServedModel(
            spec, module, metrics=self._metrics, warmup_inputs=warmup, pools=self._pools,
            on_failed=None if on_failed is None else lambda reason: on_failed(served, reason),
            memory=memory, devices=self._devices, delivery=self._delivery,
        )
        try:
            served.start()
        except BaseException:
            served.stop(0.0)
            raise
        log.info("model_load_report", model=name, **served.load_report)
        return _Loaded(served, model_spec.effective_config(config, served.spec,
                                                             served.load_report), files)

    @staticmethod
    def _unexpected(name: str, exc: Exception) -> LoadError:
        log.error("model_load_crashed", model=name, exc_info=exc)
        return LoadError(
            f"model {quoted(name)} failed to load ({type(exc).__name__}); the server log has the details"
        )

    # -- bookkeeping ---------------------------------------------------------------------------

    def _model_folders(self) -> list[str]:
        """The model folders under the root: plain names, with a config."""
        try:
            entries = sorted(self._root.iterdir())
        except OSError as exc:
            log.error("repository_unreadable", repository=str(self._root), error=exc.strerror)
            return []
        return [
            entry.name
            for entry in entries
            if self._is_plain_name(entry.name) and self._has_config(entry)
        ]

    def _slot(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = _Slot(name)
        return slot

    def _set_state(self, slot: _Slot, state: str, reason: str, *, replaced: bool = False) -> None:
        """``replaced``: the model served changed while the state stayed (a reload): that is
        a change too, for whoever mirrors the served model (the executor's front ends)."""
        changed = slot.state != state or replaced
        slot.state = state
        slot.reason = reason
        if changed and self._on_state_change is not None:
            try:
                self._on_state_change(slot.name, state)
            except Exception:
                log.exception("state_callback_failed", model=slot.name, state=state)

    @staticmethod
    def _is_plain_name(name: str) -> bool:
        """Whether ``name`` can only mean a folder directly under the root."""
        return not (
            not name
            or name.startswith(".")  # also ".", ".." and hidden folders
            or "/" in name
            or "\\" in name
            or "\x00" in name
            or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
            or Path(name).is_absolute()
            or Path(name).name != name
        )

    def _model_dir(self, name: str) -> Path:
        """The folder of model ``name``, or InvalidRequest when the name could leave the root."""
        if not self._is_plain_name(name):
            raise InvalidRequest(
                f"model name must be a plain folder name under the repository (no '/', '\\', "
                f"NUL, leading '.', at most {MAX_NAME_BYTES} bytes), got {quoted(name)}"
            )
        return self._root / name

    @staticmethod
    def _has_config(model_dir: Path) -> bool:
        try:
            return (model_dir / model_config.CONFIG_FILENAME).is_file()
        except OSError:  # e.g. permission denied: as good as absent
            return False

    @staticmethod
    def _is_folder(path: Path) -> bool:
        try:
            return path.is_dir()
        except OSError:
            return False
