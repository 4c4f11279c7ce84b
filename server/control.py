"""The control plane: statistics, repository index, load and unload, as protocol messages.

``ControlPlane`` answers each control RPC's request message with its response message from a
``ModelRepository``. The process that holds the models runs it: the single-process server
calls it from its handlers; the executor process calls it for every ``Call`` a front end
forwards over the wire (``protos/wire.proto``), so front ends pass these RPCs on as the client
sent them, whatever language they are written in, and the answer is built in one place.

Errors are ``batcher.errors`` exceptions, as everywhere below the transport.
"""

from __future__ import annotations

from batcher.stats import Duration, StatsSnapshot
from protos import inference_pb2 as pb
from server.repository import ModelRepository


class ControlPlane:
    def __init__(self, repository: ModelRepository, drain_timeout_s: float = 30.0) -> None:
        """``drain_timeout_s``: how long an unloaded model's queued requests may take."""
        self._repository = repository
        self._drain_timeout_s = drain_timeout_s

    async def statistics(self, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        stats = await self._repository.statistics(request.name, request.version)
        return pb.ModelStatisticsResponse(model_stats=[_statistics(*s) for s in stats])

    async def index(self, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
        entries = self._repository.index()
        if request.ready:
            entries = [e for e in entries if e.state == "READY"]
        return pb.RepositoryIndexResponse(models=[
            pb.RepositoryIndexResponse.ModelIndex(
                name=e.name, version=e.version, state=e.state, reason=e.reason)
            for e in entries
        ])

    async def load(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        await self._repository.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def unload(self, request: pb.RepositoryModelUnloadRequest
                     ) -> pb.RepositoryModelUnloadResponse:
        await self._repository.unload(request.model_name, self._drain_timeout_s)
        return pb.RepositoryModelUnloadResponse()


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


def _statistics(name: str, version: str, snap: StatsSnapshot) -> pb.ModelStatistics:
    return pb.ModelStatistics(
        name=name,
        version=version,
        last_inference=snap.last_inference_ms,
        inference_count=snap.inference_count,
        execution_count=snap.execution_count,
        inference_stats=pb.InferStatistics(
            success=_duration(snap.success),
            fail=_duration(snap.fail),
            queue=_duration(snap.queue),
            compute_input=_duration(snap.compute_input),
            compute_infer=_duration(snap.compute_infer),
            compute_output=_duration(snap.compute_output),
        ),
        batch_stats=[
            pb.InferBatchStatistics(
                batch_size=size,
                compute_input=_duration(d.compute_input),
                compute_infer=_duration(d.compute_infer),
                compute_output=_duration(d.compute_output),
            )
            for size, d in snap.batches.items()
        ],
    )
