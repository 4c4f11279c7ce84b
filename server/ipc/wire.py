"""The wire between front ends and the executor, Python's end: frames over a Unix socket.

``protos/wire.proto`` defines the wire (messages, framing, who owns which arena block); this
module is its Python reader and writer, as ``server/native/src/executor_link.cc`` is the C++ one.
A frame is a 4-byte little-endian length and one serialized message: ``ToExecutor`` from a
front end, ``ToFrontend`` from the executor.

Writing is batched per event-loop iteration: ``Link.room(nbytes)`` is the frame being filled,
and it is written once, after the callbacks that are running now (a finished batch answers all
its requests into one frame, which costs one ``write`` system call), or as soon as its writer
calls ``Link.flush`` (the executor does once a batch's answers are in it). No frame passes
``MAX_FRAME_BYTES``: every entry is added through ``room`` with its encoded size or a bound on
it, and the frame filled so far is written first when the entry would not fit beside it (an
entry larger than a whole frame raises ``FrameFull``, for its writer to answer with an error
in its place). Reading hands over one whole
frame, which the receiver handles in one pass. The executor's end reads in the transport's
``data_received``: every whole frame of a read goes to its handler there and then, with no
reader task to wake per frame (a front end's end, which the tests and benchmarks play in
Python, awaits ``Link.receive``).

An abstract socket has no file permissions, so any local user could connect: each end checks
the other's credentials (SO_PEERCRED) and talks only to a process of its own user, which could
ptrace it anyway. Another user can then neither bypass the front ends' tokens (loading and
unloading models through the executor) nor read what clients sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

from google.protobuf.message import DecodeError, Message

from batchgate.protos import wire_pb2

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = wire_pb2.MAX_FRAME_BYTES  # wire.proto's WireLimit: the C++ end reads the same
# What ``Link.room`` keeps aside in every frame for what is not an entry: a flag (``welcome``),
# a Hello, and the tag and length of each packed list (``cancel``, ``free``, ``released``).
FRAME_SLACK_BYTES = 256
# An entry's own tag and length (field numbers under 16; a length under 2**28).
ENTRY_BYTES = 5
# A uint64 or int64 field, tag and varint, at most; a list's element (packed) takes one less.
NUMBER_BYTES = 11
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SOCKET_BUFFER_BYTES = 4 * 1024 * 1024

In = TypeVar("In", bound=Message)
Out = TypeVar("Out", bound=Message)


def socket_address(name: str) -> str:
    """The abstract-namespace address of ``name``: nothing appears on the filesystem."""
    return "\0" + name


class Link(Generic[In, Out]):
    """One end of a connection: frames of ``incoming`` type in, of ``outgoing`` type out.

    ``writer``: a StreamWriter, or the transport itself (the executor's end, whose frames come
    through ``FrameReader`` instead of ``receive``; ``reader`` is then None)."""

    def __init__(self, reader: asyncio.StreamReader | None,
                 writer: asyncio.StreamWriter | asyncio.WriteTransport,
                 incoming: type[In], outgoing: type[Out]) -> None:
        self._reader = reader
        self._writer = writer
        self._incoming = incoming
        self._outgoing = outgoing
        self._pending: Out | None = None
        self._left = 0  # bytes ``room`` may still hand out in the frame being filled
        self.peer_pid: int | None = None  # the executor's end: the front-end process
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def connect(cls, name: str, incoming: type[In], outgoing: type[Out]) -> Link[In, Out]:
        reader, writer = await asyncio.open_unix_connection(socket_address(name))
        if not same_user(writer.get_extra_info("socket")):
            writer.close()
            raise ConnectionRefusedError(f"{name} is served by another user's process")
        _tune(writer)
        return cls(reader, writer, incoming, outgoing)

    async def receive(self) -> In:
        """The next frame; ConnectionError at the end of the stream or on a malformed frame."""
        try:
            (length,) = HEADER.unpack(await self._reader.readexactly(HEADER.size))
            if length > MAX_FRAME_BYTES:
                raise ConnectionError(f"the peer sent a {length}-byte frame")
            body = await self._reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionError("the peer closed the connection") from exc
        try:
            return self._incoming.FromString(body)
        except DecodeError as exc:
            raise ConnectionError(f"the peer sent a malformed frame ({exc})") from exc

    @property
    def out(self) -> Out:
        """The frame being filled, for a flag or a Hello (``FRAME_SLACK_BYTES`` holds them):
        entries go in through ``room``. Raises ConnectionError when the connection is closed."""
        return self.room(0)

    def room(self, nbytes: int) -> Out:
        """The frame being filled, with room for ``nbytes`` more (an entry's encoded size, its
        tag and length included, or a bound on it): the frame filled so far is written first
        when it lacks the room. Written once the running callbacks have returned.

        Raises FrameFull when ``nbytes`` would not fit even an empty frame, ConnectionError
        when the connection is closed."""
        if nbytes > self._left:
            if nbytes > capacity_bytes():
                raise FrameFull(nbytes)
            self.flush()
        if self._pending is None:
            if self._writer.is_closing():
                raise ConnectionError("the connection is closed")
            self._pending = self._outgoing()
            self._left = capacity_bytes()
            deferred = _deferred.links
            if deferred is None:
                self._loop.call_soon(self.flush)
            else:
                deferred.append(self)
        self._left -= nbytes
        return self._pending

    @property
    def pending_bytes(self) -> int:
        """The encoded size of the frame being filled (0: none)."""
        return 0 if self._pending is None else self._pending.ByteSize()

    def flush(self) -> None:
        """Write the frame being filled (called at the end of the loop's turn, or earlier by
        its writer; a frame already written leaves nothing to do)."""
        frame, self._pending = self._pending, None
        self._left = 0
        if frame is None or self._writer.is_closing():
            return
        body = frame.SerializeToString()
        self._writer.write(HEADER.pack(len(body)) + body)

    def close(self) -> None:
        self._pending = None
        self._left = 0
        self._writer.close()

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()


class FrameFull(Exception):
    """An entry larger than a whole frame (``Link.room``): its writer answers with an error in
    its place."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(f"an entry of {nbytes} bytes does not fit a frame of "
                         f"{MAX_FRAME_BYTES} bytes")
        self.nbytes = nbytes


def capacity_bytes() -> int:
    """What ``Link.room`` hands out of one frame: MAX_FRAME_BYTES less FRAME_SLACK_BYTES."""
    return MAX_FRAME_BYTES - FRAME_SLACK_BYTES


def string_bytes(text: str) -> int:
    """A bound on a string field's encoded size: tag, length and UTF-8 bytes."""
    return ENTRY_BYTES + (len(text) if text.isascii() else len(text.encode()))


class _Deferred(threading.local):
    links: list[Link] | None = None  # inside ``flushed_here``: the links whose frame it writes


_deferred = _Deferred()


@contextlib.contextmanager
def flushed_here() -> Iterator[None]:
    """Frames filled in the block are written when it ends, by the thread that runs it, instead
    of at the end of the loop's turn: for work run off the loop's thread while the loop waits
    (and is kept from running: the caller's lock), which no loop callback could flush."""
    _deferred.links = links = []
    try:
        yield
    finally:
        _deferred.links = None
        for link in links:
            link.flush()


def batch_results(batch: wire_pb2.Batch) -> list[wire_pb2.Result]:
    """The Results a Batch stands for (wire.proto), one per request, in its order."""
    outputs = [(o.block, o.row_bytes, tuple(o.tail)) for o in batch.outputs]
    results = []
    for rid, first, rows in zip(batch.rids, batch.first_rows, batch.rows):
        result = wire_pb2.Result(rid=rid, released=batch.released)
        for block, row_bytes, tail in outputs:
            result.outputs.add(block=block, offset=block + first * row_bytes,
                               nbytes=rows * row_bytes, shape=(rows, *tail))
        results.append(result)
    return results


ExecutorLink = Link[wire_pb2.ToExecutor, wire_pb2.ToFrontend]  # a front end's end
FrontendLink = Link[wire_pb2.ToFrontend, wire_pb2.ToExecutor]  # the executor's end of one


async def connect_to_executor(name: str) -> ExecutorLink:
    return await Link.connect(name, wire_pb2.ToFrontend, wire_pb2.ToExecutor)


class FrameHandler(Protocol):
    """What handles one front end's frames at the executor's end (``serve_frontends``)."""

    def frame(self, frame: wire_pb2.ToExecutor) -> None:
        """One whole frame, on the event loop, in order; ConnectionError ends the connection."""

    def read(self) -> None:
        """The frames of one read of the socket have all been handed over (at least one)."""

    def lost(self, reason: ConnectionError) -> None:
        """The connection ended (``reason`` says how); called once, and no frame after it."""


async def serve_frontends(name: str, accept: Callable[[FrontendLink], FrameHandler]
                          ) -> asyncio.AbstractServer:
    """Listen on ``name``; for each front end that connects (as this user), ``accept(link)``
    gives the handler of its frames."""
    loop = asyncio.get_running_loop()
    return await loop.create_unix_server(lambda: FrameReader(accept), path=socket_address(name))


class FrameReader(asyncio.Protocol):
    """The executor's end of one front end's connection: cuts what the socket reads into
    frames and hands each whole one to its handler as soon as its last byte is read."""

    def __init__(self, accept: Callable[[FrontendLink], FrameHandler]) -> None:
        self._accept = accept
        self._transport: asyncio.Transport | None = None
        self._handler: FrameHandler | None = None
        self._buffer = bytearray()  # a frame's first bytes, until the rest is read
        self._reason: ConnectionError | None = None  # why we closed it, when we did

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        if not same_user(transport.get_extra_info("socket")):
            transport.close()  # before reading a byte of what it sent
            return
        _tune(transport)
        link = Link(None, transport, wire_pb2.ToExecutor, wire_pb2.ToFrontend)
        link.peer_pid = peer_pid(transport.get_extra_info("socket"))
        self._handler = self._accept(link)

    def data_received(self, data: bytes) -> None:
        if self._handler is None or self._reason is not None:
            return
        buffer = self._buffer
        if buffer:
            buffer += data
            data = buffer
        start, size = 0, len(data)
        handler = self._handler
        # The view goes before the buffer is resized, whatever the handler raised.
        with memoryview(data) as view:
            try:
                while size - start >= HEADER.size:
                    (length,) = HEADER.unpack_from(data, start)
                    if length > MAX_FRAME_BYTES:
                        raise ConnectionError(f"the peer sent a {length}-byte frame")
                    end = start + HEADER.size + length
                    if end > size:
                        break
                    try:
                        frame = wire_pb2.ToExecutor.FromString(view[start + HEADER.size:end])
                    except DecodeError as exc:
                        raise ConnectionError(f"the peer sent a malformed frame ({exc})") from exc
                    start = end
                    handler.frame(frame)
            except ConnectionError as exc:
                self._reason = exc
                self._transport.close()
                return
            finally:
                if start:
                    handler.read()
        if data is buffer:
            del buffer[:start]
        elif start < size:
            buffer += data[start:]

    def connection_lost(self, exc: Exception | None) -> None:
        handler, self._handler = self._handler, None
        if handler is not None:
            handler.lost(self._reason or ConnectionError("the peer closed the connection"))


def same_user(sock: socket.socket | None) -> bool:
    """Whether the process at the other end of ``sock`` runs as this process's user."""
    if sock is None:
        return False
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid == os.getuid()


def peer_pid(sock: socket.socket) -> int:
    """The process at the other end of ``sock`` (the one that connected)."""
    pid, _uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid


def _tune(writer: asyncio.StreamWriter | asyncio.BaseTransport) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
            except OSError:
                pass
