"""Where a served model's answers go: the ``Delivery`` its host hands it at construction.

A ``ServedModel`` decides when a request is answered and with what (a batch's outputs, an
error, an expiry); who the caller is and how the answer reaches it is its host's business. The
model marks each request ``answered`` before handing it on, so a delivery never sees a request
twice. Every call comes on the event loop's thread, or on the executor thread that finished a
batch while ``inline`` runs it there (the loop is then kept from running meanwhile).

``FutureDelivery`` is the default, for callers that await ``ServedModel.infer``: each request's
``caller`` is an asyncio future, resolved with the request's rows of the outputs. The executor
process (``server/executor/answers.py``) delivers a whole batch's answers in one message per
front end instead, from the batch's outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from batchgate.batcher.request import InferenceRequest


@runtime_checkable
class Delivery(Protocol):
    """What a served model answers its requests through."""

    # Whether ``results`` needs each request's own views of its rows (``per_request``); False:
    # it reads the batch's whole outputs, and no views are made.
    per_request_views: bool

    def results(self, requests: Sequence[InferenceRequest], first_rows: Sequence[int],
                outputs: list[np.ndarray],
                per_request: Sequence[dict[str, np.ndarray]] | None) -> None:
        """A batch's answers: ``requests`` (the batch's unanswered ones, in its order), the
        first row of each in ``outputs`` (the batch's host arrays, one per model output, in
        the model's order), and with ``per_request_views`` each one's own views of its rows."""

    def failed(self, requests: Sequence[InferenceRequest], error: BaseException) -> None:
        """``requests`` get ``error`` (a ``BatchgateError``, or a defect of the server's)."""

    def inline(self, delivery: Callable[[], None]) -> bool:
        """Run ``delivery`` (a finished batch's answers) here, on the executor thread that
        calls, if the host allows it now: True when it ran, False to have it run on the loop."""


class FutureDelivery:
    """Each request's ``caller`` is an asyncio future (``ServedModel.infer``), resolved on the
    loop with the request's rows of the outputs."""

    per_request_views = True

    def results(self, requests: Sequence[InferenceRequest], first_rows: Sequence[int],
                outputs: list[np.ndarray],
                per_request: Sequence[dict[str, np.ndarray]] | None) -> None:
        for request, result in zip(requests, per_request or ()):
            future = request.caller
            if future is not None and not future.done():
                future.set_result(result)

    def failed(self, requests: Sequence[InferenceRequest], error: BaseException) -> None:
        for request in requests:
            future = request.caller
            if future is not None and not future.done():
                future.set_exception(error)

    def inline(self, delivery: Callable[[], None]) -> bool:
        return False
