"""The asyncio client (grpc.aio)."""

from __future__ import annotations

import asyncio
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
)
from typing import Any

import grpc
import numpy as np

from batchgate.clients import _calls
from batchgate.clients._endpoints import ResolveError, check_timeout_s
from batchgate.clients.errors import BatchgateError
from batchgate.clients.infer import InferRequest, InferResult
from batchgate.clients.retry import RetrySchedule
from batchgate.protos import inference_pb2, model_config_pb2


class AsyncClient(_calls.ClientBase):
    """The asyncio twin of `Client`: same arguments, same methods, each awaited.

    Channels open on the first call, inside the running event loop, because a grpc.aio channel
    belongs to the loop that first uses it; use the client from that loop only. Names are
    resolved in a worker thread, so DNS never blocks the loop. Use as
    `async with AsyncClient(...)`, or `await close()`.
    """

    # Channels open on the first call, in the loop (`_pick` updates the pool there).
    _aio = True

    @property
    def addresses(self) -> list[str]:
        """The addresses in use; for a name, as last resolved (none before the first call).

        Before the first call, the addresses given (with nothing to resolve).
        """
        if not len(self._pool) and not self._source.dynamic:
            return [target for target, _ in self._source.targets]
        return self._pool.addresses

    async def close(self) -> None:
        """Close every channel; calls in flight are cancelled. A later call opens them again."""
        for endpoint in self._pool.take_all():
            await endpoint.channel.close()

    async def _pick(self, after: _calls.Endpoint | None, *, hold: bool = True) -> _calls.Endpoint:
        """The endpoint of the next attempt, resolving the addresses again when that is due."""
        pool, source = self._pool, self._source
        if source.due(empty=not len(pool), all_unhealthy=pool.all_unhealthy()):
            try:
                if source.dynamic:
                    addresses = await asyncio.to_thread(source.resolve)
                else:
                    addresses = source.resolve()
            except ResolveError as exc:
                if not len(pool):
                    raise BatchgateError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            else:
                for gone in pool.update(addresses):
                    await gone.channel.close()
        return pool.pick(after, hold=hold)

    async def _release(self, endpoint: _calls.Endpoint, code: grpc.StatusCode | None) -> None:
        if self._pool.release(endpoint, code):
            await endpoint.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _run(self, call: _calls.Call, timeout_s: float | None) -> Any:
        timeout_s = self._timeout_s if timeout_s is None else check_timeout_s(timeout_s)
        schedule = RetrySchedule(self._retry, idempotent=call.idempotent, timeout_s=timeout_s)
        endpoint = None
        while True:
            attempt_timeout_s = schedule.start_attempt()
            try:
                endpoint = await self._pick(endpoint)
            except BatchgateError as exc:
                error = exc
            else:
                try:
                    response = await call.invoke(endpoint, attempt_timeout_s)
                except grpc.RpcError as exc:
                    error = BatchgateError.from_rpc_error(exc)
                except BaseException:  # cancelled: the call is over all the same
                    await self._release(endpoint, grpc.StatusCode.CANCELLED)
                    raise
                else:
                    await self._release(endpoint, None)
                    return call.unwrap(response)
                await self._release(endpoint, error.code)
            delay_s = schedule.backoff_s(error)
            if delay_s is None:
                raise error
            await asyncio.sleep(delay_s)

    # Inference

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray], *,
                    timeout_s: float | None = None, idempotent: bool = True,
                    **fields: Any) -> dict[str, np.ndarray]:
        """Run one inference; return its outputs by name. Arguments as `Client.infer`."""
        return (await self.infer_result(model, inputs, timeout_s=timeout_s,
                                        idempotent=idempotent, **fields)).outputs

    async def infer_result(self, model: str, inputs: Mapping[str, np.ndarray], *,
                           timeout_s: float | None = None, idempotent: bool = True,
                           **fields: Any) -> InferResult:
        """Like `infer`, returning an InferResult: `.outputs`, `.id`, `.model_version`, ..."""
        call = _calls.infer(InferRequest(model, inputs, **fields), idempotent=idempotent)
        return await self._run(call, timeout_s)

    def stream_infer(
        self,
        requests: Iterable[InferRequest] | AsyncIterable[InferRequest],
        *,
        timeout_s: float | None = None,
    ) -> AsyncInferStream:
        """Send `requests` (an iterable or async iterable) on one ModelStreamInfer stream.

        Iterate the returned AsyncInferStream with `async for`. As `Client.stream_infer`.
        """
        timeout_s = self._timeout_s if timeout_s is None else check_timeout_s(timeout_s)
        requests_pb = _calls.request_protos(requests)

        async def start() -> Any:
            endpoint = await self._pick(None, hold=False)
            return endpoint.inference.ModelStreamInfer(
                requests_pb, timeout=timeout_s, metadata=endpoint.metadata)

        return AsyncInferStream(start)

    # Health, metadata, configuration

    async def server_live(self, *, timeout_s: float | None = None) -> bool:
        return await self._run(_calls.server_live(), timeout_s)

    async def server_ready(self, *, timeout_s: float | None = None) -> bool:
        return await self._run(_calls.server_ready(), timeout_s)

    async def model_ready(
        self, model: str, version: str = "", *, timeout_s: float | None = None
    ) -> bool:
        return await self._run(_calls.model_ready(model, version), timeout_s)

    async def server_metadata(
        self, *, timeout_s: float | None = None
    ) -> inference_pb2.ServerMetadataResponse:
        return await self._run(_calls.server_metadata(), timeout_s)

    async def model_metadata(
        self, model: str, version: str = "", *, timeout_s: float | None = None
    ) -> inference_pb2.ModelMetadataResponse:
        return await self._run(_calls.model_metadata(model, version), timeout_s)

    async def model_config(
        self, model: str, version: str = "", *, timeout_s: float | None = None
    ) -> model_config_pb2.ModelConfig:
        return await self._run(_calls.model_config(model, version), timeout_s)

    async def model_statistics(
        self, model: str = "", version: str = "", *, timeout_s: float | None = None
    ) -> list[inference_pb2.ModelStatistics]:
        """Statistics of one model ("" = every model), one version ("" = every version)."""
        return await self._run(_calls.model_statistics(model, version), timeout_s)

    async def repository_index(
        self, *, ready: bool = False, timeout_s: float | None = None
    ) -> list[inference_pb2.RepositoryIndexResponse.ModelIndex]:
        """The repository's models; `ready=True` lists only those ready to serve."""
        return await self._run(_calls.repository_index(ready), timeout_s)

    async def load_model(self, name: str, *, config: str | None = None,
                         files: Mapping[str, bytes] | None = None,
                         timeout_s: float | None = None) -> None:
        """Load (or reload) a model, as `Client.load_model`. Never retried."""
        await self._run(_calls.load_model(name, config, files), timeout_s)

    async def unload_model(self, name: str, *, timeout_s: float | None = None) -> None:
        """Unload a model. Never retried."""
        await self._run(_calls.unload_model(name), timeout_s)

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """grpc.health.v1 status of `service` ("" = the server): "SERVING", "NOT_SERVING", ..."""
        return await self._run(_calls.health(service), timeout_s)


class AsyncInferStream:
    """The results of `AsyncClient.stream_infer`, as an async iterator of InferResult.

    Behaves as InferStream: an error response raises BatchgateError and the stream goes on; a
    failed stream raises BatchgateError and ends. Leaving `async with` cancels it.
    """

    def __init__(self, start: Callable[[], Awaitable[Any]]) -> None:
        self._start: Callable[[], Awaitable[Any]] | None = start  # opens the call when first read
        self._call: Any = None
        self._done = False

    def __aiter__(self) -> AsyncIterator[InferResult]:
        return self

    async def __anext__(self) -> InferResult:
        if self._done:
            raise StopAsyncIteration
        if self._start is not None:
            start, self._start = self._start, None
            try:
                self._call = await start()
            except BaseException:
                self._done = True
                raise
        try:
            message = await self._call.read()
        except grpc.RpcError as exc:
            self._done = True
            error = BatchgateError.from_rpc_error(exc)
        else:
            if message is grpc.aio.EOF:
                self._done = True
                raise StopAsyncIteration
            return _calls.stream_result(message)
        raise error

    def cancel(self) -> None:
        """Stop the stream; requests not yet answered are abandoned."""
        if self._call is None:  # not started: nothing was sent
            self._start, self._done = None, True
        else:
            self._call.cancel()

    async def __aenter__(self) -> AsyncInferStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._done:
            self.cancel()
