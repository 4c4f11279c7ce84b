"""One gRPC call written as raw HTTP/2 frames, for headers no gRPC client sends.

grpcio refuses a timeout past what its own deadline arithmetic holds (99999999 hours comes back
DEADLINE_EXCEEDED before a byte is sent), so a test that needs the header a hostile client may
send (``grpc-timeout: 99999999H``) writes the call itself: the client preface, an empty
SETTINGS, one HEADERS frame (HPACK literals, no Huffman, no table), one DATA frame with the
length-prefixed message, then reads frames until the stream ends. Only the reply's messages
are decoded (DATA frames); a call answered with an error has none (its status is in trailers,
which this does not decode).
"""

from __future__ import annotations

import socket
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING = 0x0, 0x1, 0x3, 0x4, 0x6
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
STREAM = 1


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing, new name (lengths under 127)."""
    name_bytes, value_bytes = name.encode(), value.encode()
    assert len(name_bytes) < 127 and len(value_bytes) < 127
    return b"\x00" + bytes([len(name_bytes)]) + name_bytes + bytes([len(value_bytes)]) + \
        value_bytes


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    return bytes(data)


def unary_call(address: str, path: str, message: bytes, headers: dict[str, str],
               timeout_s: float = 60.0) -> list[bytes]:
    """Call ``path`` on ``address`` ("host:port") with ``message`` and the extra ``headers``;
    the messages of the reply (none when it failed). ConnectionError when the server dropped
    the connection or reset the stream."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        block = b"".join(_literal(k, v) for k, v in {
            ":method": "POST", ":scheme": "http", ":path": path, ":authority": address,
            "content-type": "application/grpc", "te": "trailers", **headers}.items())
        body = b"\x00" + struct.pack(">I", len(message)) + message
        sock.sendall(PREFACE + _frame(SETTINGS, 0, 0, b"")
                     + _frame(HEADERS, END_HEADERS, STREAM, block)
                     + _frame(DATA, END_STREAM, STREAM, body))
        data = bytearray()
        while True:
            header = _read_exactly(sock, 9)
            length = int.from_bytes(header[:3], "big")
            kind, flags = header[3], header[4]
            stream = struct.unpack(">I", header[5:9])[0] & 0x7FFFFFFF
            payload = _read_exactly(sock, length)
            if kind == SETTINGS and not flags & ACK:
                sock.sendall(_frame(SETTINGS, ACK, 0, b""))
            elif kind == PING and not flags & ACK:
                sock.sendall(_frame(PING, ACK, 0, payload))
            elif kind == RST_STREAM and stream == STREAM:
                raise ConnectionError("the server reset the stream")
            elif stream == STREAM and kind == DATA:
                data += payload
            if stream == STREAM and kind in (DATA, HEADERS) and flags & END_STREAM:
                break
    messages, at = [], 0
    while at + 5 <= len(data):
        (size,) = struct.unpack(">I", data[at + 1:at + 5])
        messages.append(bytes(data[at + 5:at + 5 + size]))
        at += 5 + size
    return messages
