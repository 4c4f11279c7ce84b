"""The control plane: statistics, repository index, load and unload, as protocol messages.

``ControlPlane`` answers each control RPC's request message with its response message from a
``ModelRepository``. The process that holds the models runs it: the single-process server
calls it from its handlers; the executor process calls it for every ``Call`` a front end
forwards over the wire (``protos/wire.proto``), so front ends pass these RPCs on as the client
sent them, whatever language they are written in, and the answer is built in one place.

Load and unload parameters are Triton's, and any other is refused (INVALID_ARGUMENT), never
ignored: a load takes ``config`` (a string: the ``ModelConfig`` as JSON, in place of
``config.pbtxt``) and ``file:<path>`` (bytes: a file of the model folder, which the files then
make up whole; they need ``config``); an unload takes ``unload_dependents`` (a bool: batchgate
has no ensembles, so no model depends on another and there is nothing more to unload).
The three repository RPCs refuse a ``repository_name`` (UNIMPLEMENTED, as Triton does): the
server serves one repository, and a name it cannot act on is not taken as "that one".

Errors are ``batchgate.batcher.errors`` exceptions, as everywhere below the transport.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from batchgate.batcher.errors import InvalidRequest, NotSupported, ResourceExhausted, quoted
from batchgate.batcher.stats import BATCH_DURATIONS, INFER_DURATIONS, StatsSnapshot
from batchgate.protos import inference_pb2 as pb
from batchgate.server.config import model_config
from batchgate.server.config.settings import Settings
from batchgate.server.executor.load_override import LoadOverride, file_path
from batchgate.server.executor.repository import ModelRepository

CONFIG_PARAMETER = "config"
FILE_PREFIX = "file:"
UNLOAD_DEPENDENTS = "unload_dependents"


class ControlPlane:
    def __init__(self, repository: ModelRepository, drain_timeout_s: float = 30.0,
                 max_load_files_bytes: int = Settings.max_load_files_bytes) -> None:
        """``drain_timeout_s``: how long an unloaded model's queued requests may take;
        ``max_load_files_bytes``: the most bytes of ``file:`` contents one load may bring."""
        self._repository = repository
        self._drain_timeout_s = drain_timeout_s
        self._max_load_files_bytes = max_load_files_bytes

    def handlers(self) -> dict[type, Callable[[Any], Awaitable[Any]]]:
        """Each request message type this plane answers, and what answers it."""
        return {pb.ModelStatisticsRequest: self.statistics,
                pb.RepositoryIndexRequest: self.index,
                pb.RepositoryModelLoadRequest: self.load,
                pb.RepositoryModelUnloadRequest: self.unload}

    async def statistics(self, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        stats = await self._repository.statistics(request.name, request.version)
        return pb.ModelStatisticsResponse(model_stats=[_statistics(*s) for s in stats])

    async def index(self, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
        _one_repository(request.repository_name)
        entries = self._repository.index()
        if request.ready:
            entries = [e for e in entries if e.state == "READY"]
        return pb.RepositoryIndexResponse(models=[
            pb.RepositoryIndexResponse.ModelIndex(
                name=e.name, version=e.version, state=e.state, reason=e.reason)
            for e in entries
        ])

    async def load(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        _one_repository(request.repository_name)
        override = self._load_override(request.parameters) if request.parameters else None
        await self._repository.load(request.model_name, override)
        return pb.RepositoryModelLoadResponse()

    async def unload(self, request: pb.RepositoryModelUnloadRequest
                     ) -> pb.RepositoryModelUnloadResponse:
        _one_repository(request.repository_name)
        for key in sorted(request.parameters):
            if key != UNLOAD_DEPENDENTS:
                raise InvalidRequest(
                    f"unknown unload parameter {quoted(key)}: RepositoryModelUnload takes "
                    f"{UNLOAD_DEPENDENTS!r} (bool) only")
            _parameter(request.parameters[key], key, "bool_param", "a bool")
        await self._repository.unload(request.model_name, self._drain_timeout_s)
        return pb.RepositoryModelUnloadResponse()

    def _load_override(self, parameters) -> LoadOverride:
        """A load request's parameters, checked; InvalidRequest or ResourceExhausted."""
        config_text: str | None = None
        files = {}
        total = 0
        for key in sorted(parameters):
            value = parameters[key]
            if key == CONFIG_PARAMETER:
                config_text = _parameter(value, key, "string_param",
                                         "a string holding the model configuration as JSON")
            elif key.startswith(FILE_PREFIX):
                data = _parameter(value, key, "bytes_param", "bytes: the file's contents")
                files[file_path(key[len(FILE_PREFIX):])] = data
                total += len(data)
            else:
                raise InvalidRequest(
                    f"unknown load parameter {quoted(key)}: RepositoryModelLoad takes "
                    f"{CONFIG_PARAMETER!r} (the model configuration as JSON) and "
                    f"'{FILE_PREFIX}<path>' (a file's contents) only")
        limit = self._max_load_files_bytes
        if files and limit == 0:
            raise ResourceExhausted(
                f"this server takes no loads with {FILE_PREFIX} parameters "
                "(--max-load-files-bytes 0)")
        if total > limit:
            raise ResourceExhausted(
                f"the load's {FILE_PREFIX} parameters hold {total} bytes, more than "
                f"--max-load-files-bytes {limit}")
        config = None if config_text is None else model_config.config_from_json(config_text)
        return LoadOverride(config, files)


def _one_repository(name: str) -> None:
    if name:
        raise NotSupported(
            f"repository_name {quoted(name)} is not supported: this server serves one model "
            "repository (--model-repository); leave repository_name empty")


def _parameter(value: pb.ModelRepositoryParameter, key: str, kind: str, what: str):
    """The value of parameter ``key`` when it is set as ``kind``; InvalidRequest otherwise."""
    sent = value.WhichOneof("parameter_choice")
    if sent != kind:
        raise InvalidRequest(
            f"parameter {quoted(key)} must be {what} ({kind}), got {sent or 'no value'}")
    return getattr(value, kind)


def _durations(source: Any, names: tuple[str, ...]) -> dict[str, pb.StatisticDuration]:
    return {name: pb.StatisticDuration(count=(d := getattr(source, name)).count, ns=d.ns)
            for name in names}


def _statistics(name: str, version: str, snap: StatsSnapshot) -> pb.ModelStatistics:
    return pb.ModelStatistics(
        name=name,
        version=version,
        last_inference=snap.last_inference_ms,
        inference_count=snap.inference_count,
        execution_count=snap.execution_count,
        inference_stats=pb.InferStatistics(**_durations(snap, INFER_DURATIONS)),
        batch_stats=[
            pb.InferBatchStatistics(batch_size=size, **_durations(d, BATCH_DURATIONS))
            for size, d in snap.batches.items()
        ],
    )
