"""The blocking client."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import grpc
import numpy as np

from batchgate.clients import _calls
from batchgate.clients._endpoints import ResolveError, check_timeout_s
from batchgate.clients.errors import BatchgateError
from batchgate.clients.infer import InferRequest, InferResult
from batchgate.clients.retry import RetrySchedule
from batchgate.protos import inference_pb2, model_config_pb2


class Client(_calls.ClientBase):
    """A blocking client of one batchgate (or any KServe v2 gRPC) server, or of several.

    `address`: "host:port", or a list of them; calls take turns over the addresses (one channel
    each) and a retry goes to the next one. "dns:///host:port" (or `resolve=True`) stands for
    every A/AAAA record of the name, resolved on the first call, again every
    `resolve_interval_s` and when every address has failed (`resolver`: a function from
    "host:port" to a list of addresses, instead of DNS). An address whose call failed with
    UNAVAILABLE is skipped for `unhealthy_for_s` (doubled on each further failure, up to 30 s;
    0: never skipped) while another is healthy. `timeout_s`: the default deadline of every call,
    retries included (None: no deadline). `retry`: see RetryPolicy (None: the defaults).
    `tls=True`: TLS, trusting the system's CAs, or `root_certificates`; `certificate_chain`
    and `private_key`: this client's own certificate, for mutual TLS (each PEM bytes or a
    file path; any of them implies TLS). `credentials`: any grpc.ChannelCredentials instead
    (None and no TLS option: plaintext). `token`: a bearer token, sent as
    `authorization: Bearer <token>` metadata on every call.
    `max_message_bytes`: send and receive limit. `options`: further gRPC channel arguments.
    Thread-safe; use as a context manager or call `close()`.
    """

    _aio = False
    _closed = False  # close() sets it

    @property
    def addresses(self) -> list[str]:
        """The addresses in use; for a name, as last resolved (none before the first call)."""
        return self._pool.addresses

    def close(self) -> None:
        """Close every channel; calls in flight are cancelled."""
        self._closed = True
        for endpoint in self._pool.take_all():
            endpoint.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, call: _calls.Call, timeout_s: float | None) -> Any:
        timeout_s = self._timeout_s if timeout_s is None else check_timeout_s(timeout_s)
        schedule = RetrySchedule(self._retry, idempotent=call.idempotent, timeout_s=timeout_s)
        endpoint = None
        while True:
            attempt_timeout_s = schedule.start_attempt()
            try:
                # No address yet (a name that does not resolve) fails like an unreachable one.
                endpoint = self._pick(endpoint)
            except BatchgateError as exc:
                error = exc
            else:
                try:
                    response = call.invoke(endpoint, attempt_timeout_s)
                except grpc.RpcError as exc:
                    error = BatchgateError.from_rpc_error(exc)
                except BaseException:
                    self._release(endpoint, grpc.StatusCode.CANCELLED)
                    raise
                else:
                    self._release(endpoint, None)
                    return call.unwrap(response)
                self._release(endpoint, error.code)
            # Raised outside the except block so the traceback is not the RpcError's.
            delay_s = schedule.backoff_s(error)
            if delay_s is None:
                raise error
            time.sleep(delay_s)

    def _pick(self, after: _calls.Endpoint | None, *, hold: bool = True) -> _calls.Endpoint:
        """The endpoint of the next attempt, resolving the addresses again when that is due."""
        if self._closed:
            raise ValueError("the client is closed")
        pool = self._pool
        if self._source.due(empty=not len(pool), all_unhealthy=pool.all_unhealthy()):
            try:
                addresses = self._source.resolve()
            except ResolveError as exc:
                if not len(pool):
                    raise BatchgateError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            else:
                for gone in pool.update(addresses):
                    gone.channel.close()
        return pool.pick(after, hold=hold)

    def _release(self, endpoint: _calls.Endpoint, code: grpc.StatusCode | None) -> None:
        if self._pool.release(endpoint, code):
            endpoint.channel.close()

    # Inference

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], *,
              timeout_s: float | None = None, idempotent: bool = True,
              **fields: Any) -> dict[str, np.ndarray]:
        """Run one inference; return its outputs by name (see `infer_result` for the metadata).

        `fields`: the rest of the request, as `InferRequest` names them: `outputs` (names to
        return; None: all), `version`, `request_id`, `priority` (1 is the highest level, None or
        0 the model's default), `timeout_us` (the server-side queue timeout in microseconds),
        `parameters`, `datatypes`. `timeout_s`: this call's deadline, retries included.
        `idempotent=False`: never retry.
        """
        return self.infer_result(model, inputs, timeout_s=timeout_s, idempotent=idempotent,
                                 **fields).outputs

    def infer_result(self, model: str, inputs: Mapping[str, np.ndarray], *,
                     timeout_s: float | None = None, idempotent: bool = True,
                     **fields: Any) -> InferResult:
        """Like `infer`, returning an InferResult: `.outputs`, `.id`, `.model_version`, ..."""
        call = _calls.infer(InferRequest(model, inputs, **fields), idempotent=idempotent)
        return self._run(call, timeout_s)

    def stream_infer(
        self, requests: Iterable[InferRequest], *, timeout_s: float | None = None
    ) -> InferStream:
        """Send `requests` on one ModelStreamInfer stream; iterate the InferStream it returns.

        Requests are sent as the iterable yields them (a generator can keep feeding the stream);
        results come in the order the server answers. `timeout_s` bounds the whole stream.
        Streams are not retried.
        """
        timeout_s = self._timeout_s if timeout_s is None else check_timeout_s(timeout_s)
        endpoint = self._pick(None, hold=False)
        requests_pb = _calls.request_protos(requests)
        call = endpoint.inference.ModelStreamInfer(
            requests_pb, timeout=timeout_s, metadata=endpoint.metadata)
        return InferStream(call)

    # Health, metadata, configuration

    def server_live(self, *, timeout_s: float | None = None) -> bool:
        return self._run(_calls.server_live(), timeout_s)

    def server_ready(self, *, timeout_s: float | None = None) -> bool:
        return self._run(_calls.server_ready(), timeout_s)

    def model_ready(self, model: str, version: str = "", *, timeout_s: float | None = None) -> bool:
        return self._run(_calls.model_ready(model, version), timeout_s)

    def server_metadata(
        self, *, timeout_s: float | None = None
    ) -> inference_pb2.ServerMetadataResponse:
        return self._run(_calls.server_metadata(), timeout_s)

    def model_metadata(
        self, model: str, version: str = "", *, timeout_s: float | None = None
    ) -> inference_pb2.ModelMetadataResponse:
        return self._run(_calls.model_metadata(model, version), timeout_s)

    def model_config(
        self, model: str, version: str = "", *, timeout_s: float | None = None
    ) -> model_config_pb2.ModelConfig:
        return self._run(_calls.model_config(model, version), timeout_s)

    def model_statistics(
        self, model: str = "", version: str = "", *, timeout_s: float | None = None
    ) -> list[inference_pb2.ModelStatistics]:
        """Statistics of one model ("" = every model), one version ("" = every version)."""
        return self._run(_calls.model_statistics(model, version), timeout_s)

    def repository_index(
        self, *, ready: bool = False, timeout_s: float | None = None
    ) -> list[inference_pb2.RepositoryIndexResponse.ModelIndex]:
        """The repository's models; `ready=True` lists only those ready to serve."""
        return self._run(_calls.repository_index(ready), timeout_s)

    def load_model(
        self,
        name: str,
        *,
        config: str | None = None,
        files: Mapping[str, bytes] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Load (or reload) a model. Never retried. `config`: a JSON model configuration, in
        place of the model's config.pbtxt (whole); `files`: the model folder's files by path
        ("1/model.py" -> contents), sent as Triton's "file:<path>" parameters, with `config`."""
        self._run(_calls.load_model(name, config, files), timeout_s)

    def unload_model(self, name: str, *, timeout_s: float | None = None) -> None:
        """Unload a model. Never retried."""
        self._run(_calls.unload_model(name), timeout_s)

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """grpc.health.v1 status of `service` ("" = the server): "SERVING", "NOT_SERVING", ..."""
        return self._run(_calls.health(service), timeout_s)


class InferStream:
    """The results of `Client.stream_infer`, as an iterator of InferResult.

    A response the server marks as an error raises BatchgateError from `next()`, and the stream
    goes on: iterate again for the following results. When the stream itself fails, the
    BatchgateError ends it. Leaving the `with` block cancels a stream still open.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._done = False

    def __iter__(self) -> Iterator[InferResult]:
        return self

    def __next__(self) -> InferResult:
        if self._done:
            raise StopIteration
        try:
            message = next(self._call)
        except StopIteration:
            self._done = True
            raise
        except grpc.RpcError as exc:
            self._done = True
            error = BatchgateError.from_rpc_error(exc)
        else:
            return _calls.stream_result(message)
        raise error

    def cancel(self) -> None:
        """Stop the stream; requests not yet answered are abandoned."""
        self._call.cancel()

    def __enter__(self) -> InferStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._done:
            self.cancel()

