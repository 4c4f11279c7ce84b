"""The wire between front-end processes and the executor process.

One Unix stream socket per front end, in Linux's abstract namespace (no file is ever created).
Each message is a 4-byte little-endian length and a pickled tuple whose first item names it.
Only descriptors cross: tensors stay in the shared arena (``batcher/arena.py``); a descriptor
says where (offset, datatype, shape).

Front end → executor:

- ``("hello", slot)``: the executor answers with a ``models`` message, then pushes a ``model``
  message on every model state change;
- ``("infer", rid, model, version, inputs, batch_size, priority, deadline, timeout_us,
  request_id, requested_outputs)`` with ``inputs`` a tuple of ``(offset, datatype, shape)`` in
  the model's input order (``("inline", array)`` for BYTES, which has no fixed layout) and
  ``deadline`` on the system-wide ``time.monotonic()`` clock (or None);
- ``("cancel", rid)``: the client went away;
- ``("free", offsets)``: output blocks the front end has copied out;
- ``("call", cid, method, args)``: statistics, repository index, load, unload.

Executor → front end:

- ``("models", [model_info, ...])`` and ``("model", model_info)``: ``model_info`` is
  ``(name, state, reason, spec, config_bytes)`` (``spec`` a ModelSpec, or None when not READY);
- ``("result", rid, released, outputs)`` with ``outputs`` a tuple of
  ``(name, offset, datatype, shape)`` in the executor's output region
  (``(name, "inline", datatype, array)`` for BYTES);
- ``("error", rid, released, error_class, message)``: ``error_class`` names a
  ``batcher.errors`` class;
- ``("release", rid)``: the request's inputs are no longer read (sent only when a ``result`` or
  ``error`` went out with ``released`` false: a request that expired while its batch ran);
- ``("return", cid, value)`` / ``("raise", cid, error_class, message)`` answer a ``call``.

An abstract socket has no file permissions: any local user could connect, and a pickle is code.
So each end checks the other's credentials (SO_PEERCRED) and talks only to a process of its own
user, which could ptrace it anyway: another user can neither bypass the front ends' tokens
(loading and unloading models through the executor) nor run code in either process.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import struct

from batcher import errors

_LENGTH = struct.Struct("<I")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def socket_address(name: str) -> str:
    """The abstract-namespace address of ``name``: nothing appears on the filesystem."""
    return "\0" + name


def error_from(error_class: str, message: str) -> errors.BatchgateError:
    cls = getattr(errors, error_class, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.BatchgateError)):
        cls = errors.ModelExecutionError
    return cls(message)


def encode(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class Channel:
    """Framed, pickled messages over an asyncio stream pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._outgoing: list[bytes] = []

    @classmethod
    async def connect(cls, name: str) -> Channel:
        reader, writer = await asyncio.open_unix_connection(socket_address(name))
        if not _same_user(writer):
            writer.close()
            raise ConnectionRefusedError(f"{name} is served by another user's process")
        _tune(writer)
        return cls(reader, writer)

    async def receive(self) -> tuple:
        """The next message; raises ConnectionError at the end of the stream."""
        try:
            header = await self._reader.readexactly(4)
            (length,) = _LENGTH.unpack(header)
            if length > MAX_MESSAGE_BYTES:
                raise ConnectionError(f"peer sent a {length}-byte message")
            body = await self._reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionError("peer closed the connection") from exc
        return pickle.loads(body)

    def send(self, message: tuple) -> None:
        """Queue ``message``; it is written with the others sent in this loop iteration.

        One write per iteration instead of one per message: a finished batch answers all its
        requests at once, and each write is a system call.
        """
        if self._writer.is_closing():
            raise ConnectionError("the connection is closed")
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(encode(message))

    def _flush(self) -> None:
        if self._outgoing and not self._writer.is_closing():
            self._writer.write(b"".join(self._outgoing))
        self._outgoing.clear()

    def close(self) -> None:
        self._writer.close()

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()


async def serve(name: str, handler) -> asyncio.AbstractServer:
    """Listen on ``name``; ``handler(channel)`` runs for each connection."""

    async def on_connect(reader, writer):
        if not _same_user(writer):
            writer.close()  # before reading a byte of what it sent
            return
        _tune(writer)
        await handler(Channel(reader, writer))

    return await asyncio.start_unix_server(on_connect, path=socket_address(name))


def _same_user(writer: asyncio.StreamWriter) -> bool:
    """Whether the process at the other end runs as this process's user."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return False
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid == os.getuid()


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, 4 * 1024 * 1024)
            except OSError:
                pass
