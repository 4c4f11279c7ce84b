"""A bare HTTP/2 connection to a gRPC server, for what no gRPC client shows: the server's
SETTINGS, its keepalive PINGs, the GOAWAY it sends (idle, age, too many pings).

``Http2Connection(address)`` sends the preface and an empty SETTINGS, acknowledges the server's
SETTINGS and PINGs as a client must, and keeps every frame it read (``frames``); ``wait_for``
reads until a frame of a type arrives or a deadline passes (a poll with a deadline, not a
timing). TLS: pass an ``ssl.SSLContext`` (ALPN "h2" is set on it).
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
ACK = 0x1
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
NO_ERROR, ENHANCE_YOUR_CALM = 0x0, 0xB


@dataclass
class Frame:
    type: int
    flags: int
    stream: int
    payload: bytes

    def settings(self) -> dict[int, int]:
        return {key: value for key, value in struct.iter_unpack(">HI", self.payload)}

    def goaway(self) -> tuple[int, int, bytes]:
        """(last stream id, error code, debug data)."""
        last, code = struct.unpack(">II", self.payload[:8])
        return last & 0x7FFFFFFF, code, self.payload[8:]


class Http2Connection:
    def __init__(self, address: str, context: ssl.SSLContext | None = None,
                 timeout_s: float = 30, *, ack_pings: bool = True) -> None:
        """``ack_pings``: answer the server's PINGs (False: a client that went silent)."""
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        if context is not None:
            context.set_alpn_protocols(["h2"])
            sock = context.wrap_socket(sock, server_hostname="localhost")
        self.sock = sock
        self.frames: list[Frame] = []
        self._buffer = b""
        self.closed = False
        self.ack_pings = ack_pings
        sock.sendall(PREFACE + self._frame(SETTINGS, 0, 0, b""))

    @staticmethod
    def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
            ">I", stream) + payload

    def send_ping(self, data: bytes = b"12345678") -> None:
        self.sock.sendall(self._frame(PING, 0, 0, data))

    def read_frame(self, deadline: float) -> Frame | None:
        """The next frame, None once the server closed the connection or ``deadline`` passed;
        SETTINGS and PINGs are acknowledged as they come."""
        while len(self._buffer) < 9 or len(self._buffer) < 9 + int.from_bytes(
                self._buffer[:3], "big"):
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                return None
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except (socket.timeout, TimeoutError):
                return None
            except (ConnectionError, ssl.SSLError, OSError):
                chunk = b""
            if not chunk:
                self.closed = True
                return None
            self._buffer += chunk
        length = int.from_bytes(self._buffer[:3], "big")
        kind, flags = self._buffer[3], self._buffer[4]
        stream = int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF
        frame = Frame(kind, flags, stream, self._buffer[9:9 + length])
        self._buffer = self._buffer[9 + length:]
        self.frames.append(frame)
        try:
            if kind == SETTINGS and not flags & ACK:
                self.sock.sendall(self._frame(SETTINGS, ACK, 0, b""))
            elif kind == PING and not flags & ACK and self.ack_pings:
                self.sock.sendall(self._frame(PING, ACK, 0, frame.payload))
        except OSError:
            self.closed = True
        return frame

    def wait_for(self, kind: int, timeout_s: float = 30, flags: int | None = None) -> Frame:
        """The first frame of ``kind`` (with exactly ``flags``, when given) read from now on;
        AssertionError naming what came instead once ``timeout_s`` passed or the server
        closed the connection."""
        deadline = time.monotonic() + timeout_s
        while True:
            frame = self.read_frame(deadline)
            if frame is None:
                seen = [(f.type, f.flags) for f in self.frames]
                raise AssertionError(f"no frame of type {kind} within {timeout_s:g} s "
                                     f"(closed: {self.closed}); frames seen {seen}")
            if frame.type == kind and (flags is None or frame.flags == flags):
                return frame

    def wait_for_close(self, timeout_s: float = 30) -> None:
        """Reads until the server closes the connection (a GOAWAY may come first);
        AssertionError if it has not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.closed:
            if self.read_frame(deadline) is None and not self.closed:
                raise AssertionError(f"the connection is still open after {timeout_s:g} s")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Http2Connection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
