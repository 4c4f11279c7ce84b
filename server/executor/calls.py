"""Control-plane calls a front end forwards (``wire.Call``), answered in the executor process.

A Call carries the client's request message as it was sent; the executor answers it by the
message's type (the control plane's and the shared-memory registry's ``handlers``), and the
Reply carries the response in the field of the response's type. Neither end names a method.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import Message

from batchgate.protos import wire_pb2
from batchgate.server.ipc import wire
from batchgate.server.executor.fronts import FrontEnd
from batchgate.server.rules.status import Code, status_of

# cid, the outcome's tag and length; the outcome on top.
_REPLY_BYTES = wire.ENTRY_BYTES + wire.NUMBER_BYTES + wire.ENTRY_BYTES
# The Reply field that carries each response type.
_REPLY_FIELDS = {field.message_type.full_name: field.name
                 for field in wire_pb2.Reply.DESCRIPTOR.oneofs_by_name["outcome"].fields}

Handler = Callable[[Any], Awaitable[Message]]


class ControlCalls:
    """Request message type -> what answers it; each Call runs as a task of its own."""

    def __init__(self, *tables: dict[type, Handler]) -> None:
        self._handlers: dict[type, Handler] = {}
        for table in tables:
            self._handlers.update(table)
        self._running: set[asyncio.Task] = set()

    def start(self, front: FrontEnd, call: wire_pb2.Call) -> None:
        # A strong reference until it ends: the loop keeps only weak ones.
        task = asyncio.create_task(self._answer(front, call))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _answer(self, front: FrontEnd, call: wire_pb2.Call) -> None:
        # The one message field set besides cid: the client's request.
        request = next((value for field, value in call.ListFields()
                        if field.message_type is not None), None)
        handler = self._handlers.get(type(request))
        if handler is None:
            _reply_error(front, call.cid, Code.UNIMPLEMENTED,
                         "the executor process does not answer this call")
            return
        try:
            response = await handler(request)
        except Exception as exc:
            _reply_error(front, call.cid, *status_of(exc))
            return
        nbytes = _REPLY_BYTES + response.ByteSize()
        if nbytes > wire.capacity_bytes():
            _reply_error(front, call.cid, Code.RESOURCE_EXHAUSTED, (
                f"the reply is {nbytes} bytes, more than one frame from the executor process "
                f"to the front end holds ({wire.MAX_FRAME_BYTES} bytes)"))
            return
        out = front.out(nbytes)
        if out is not None:
            out.replies.add(cid=call.cid,
                            **{_REPLY_FIELDS[response.DESCRIPTOR.full_name]: response})


def _reply_error(front: FrontEnd, cid: int, code: int, text: str) -> None:
    error = wire_pb2.Status(code=code, message=text)
    out = front.out(_REPLY_BYTES + error.ByteSize())
    if out is not None:
        out.replies.add(cid=cid, error=error)
