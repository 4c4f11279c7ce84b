"""A real process on one end of the executor wire (``protos/wire.proto``), the test on the other.

``NativeFrontEnd`` starts the native front end's binary with the handover the supervisor would
write (``server/supervisor/supervisor.py``), connected to a ``FakeExecutor`` the test plays: it listens on
the abstract socket, reads the front end's frames and writes what an executor would (or what
no executor should). ``ExecutorProcess`` starts the real executor process, for tests that play
a front end with ``FakeFrontEnd``. The test owns the arena in both cases, so it reads and writes
the bytes the descriptors name. Every read has a deadline: a frame that never comes fails the
test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.protos import model_config_pb2, wire_pb2
from batchgate.server import server_extensions
from batchgate.server.supervisor import native_binary as native
from batchgate.server.ipc import wire
from batchgate.server.supervisor.posix import hand_over, reserve_port
from batchgate.server.config.settings import EXECUTOR, FRONTEND, Settings
from batchgate.server.supervisor.handover import frontend_handover

READ_TIMEOUT_S = 30.0


def socket_name(what: str) -> str:
    return f"batchgate-test-{what}-{os.getpid()}-{os.urandom(4).hex()}"


def frame_bytes(message) -> bytes:
    body = message.SerializeToString()
    return wire.HEADER.pack(len(body)) + body


class _Framed:
    """One connected socket, read and written as frames of ``incoming`` / any message."""

    def __init__(self, sock: socket.socket, incoming) -> None:
        self.sock = sock
        self.incoming = incoming
        sock.settimeout(READ_TIMEOUT_S)

    def read(self):
        """The next frame; ConnectionError when the peer closed the connection."""
        (length,) = wire.HEADER.unpack(self._exactly(wire.HEADER.size))
        return self.incoming.FromString(self._exactly(length))

    def write(self, message) -> None:
        self.write_raw(frame_bytes(message))

    def write_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed_by_peer(self) -> bool:
        """Whether the peer closed its end (reads what it sent meanwhile and drops it)."""
        try:
            while True:
                if not self.sock.recv(1 << 20):
                    return True
        except (ConnectionError, OSError):
            return True

    def close(self) -> None:
        self.sock.close()

    def _exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self.sock.recv(min(size - len(data), 1 << 20))
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            data += chunk
        return bytes(data)


class ExecutorEnd(_Framed):
    """The fake executor's end of one front end's connection."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock, wire_pb2.ToExecutor)

    def read_hello(self) -> wire_pb2.Hello:
        frame = self.read()
        assert frame.HasField("hello"), frame
        return frame.hello

    def welcome(self, *models: wire_pb2.ModelState, **fields) -> None:
        self.write(wire_pb2.ToFrontend(welcome=True, models=models, **fields))

    def read_until(self, done, what: str):
        """Read frames until ``done(frame)`` is true for one; that frame."""
        while True:
            frame = self.read()
            if done(frame):
                return frame


class FakeExecutor:
    """The executor's listening socket, played by the test."""

    def __init__(self) -> None:
        self.name = socket_name("executor")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(wire.socket_address(self.name))
        self._listener.listen(16)
        self._listener.settimeout(READ_TIMEOUT_S)

    def accept(self) -> ExecutorEnd:
        sock, _ = self._listener.accept()
        return ExecutorEnd(sock)

    def accept_times(self, count: int) -> list[float]:
        """Accept ``count`` connections, closing each at once: when each came (monotonic)."""
        times = []
        for _ in range(count):
            sock, _ = self._listener.accept()
            times.append(time.monotonic())
            sock.close()
        return times

    def close(self) -> None:
        self._listener.close()


def model_state(name: str = "m", handle: int = 1, dims: tuple[int, ...] = (4,),
                datatype: str = "FP32", max_batch_size: int = 8) -> wire_pb2.ModelState:
    """A READY model with input ``x`` and output ``y`` of ``dims`` (past the batch dimension)."""
    spec = wire_pb2.ModelSpec(
        name=name, version="1", platform="pytorch_libtorch", max_batch_size=max_batch_size,
        inputs=[wire_pb2.TensorSpec(name="x", datatype=datatype, dims=dims)],
        outputs=[wire_pb2.TensorSpec(name="y", datatype=datatype, dims=dims)])
    config = model_config_pb2.ModelConfig(name=name, platform="pytorch_libtorch",
                                          max_batch_size=max_batch_size)
    return wire_pb2.ModelState(name=name, state="READY", handle=handle, spec=spec, config=config)


class _Child:
    """A child process started with a handover, its JSON log lines kept as they come."""

    def __init__(self, argv: list[str], handover: bytes, pass_fds: tuple[int, ...],
                 env: dict[str, str] | None = None) -> None:
        self.lines: list[dict] = []
        self.raw: list[bytes] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                                     pass_fds=pass_fds, start_new_session=True,
                                     env=env if env is not None else dict(os.environ))
        hand_over(self.proc, handover)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stderr:
            with self._changed:
                self.raw.append(raw)
                try:
                    line = json.loads(raw)
                except ValueError:
                    line = None
                if isinstance(line, dict):
                    self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def events(self, name: str) -> list[dict]:
        with self._changed:
            return [line for line in self.lines if line.get("event") == name]

    def wait_for(self, name: str, count: int = 1, timeout_s: float = READ_TIMEOUT_S) -> list[dict]:
        """The first ``count`` lines of event ``name``, once logged."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = [line for line in self.lines if line.get("event") == name]
                if len(found) >= count:
                    return found[:count]
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no {count} {name!r} lines; log:\n" + self.log_tail())
                self._changed.wait(left)

    def log_tail(self, lines: int = 30) -> str:
        with self._changed:
            return b"".join(self.raw[-lines:]).decode(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


def _settings(**overrides) -> Settings:
    values = dict(host="127.0.0.1", grpc_port=0, metrics_port=None, arena_bytes=64 << 20,
                  drain_timeout_s=1.0)
    values.update(overrides)
    return Settings(**values)


class NativeFrontEnd(_Child):
    """The native front end (``slot`` of ``slots``) on ``arena``, its executor at ``socket``."""

    def __init__(self, arena: SharedArena, executor_socket: str, *, slot: int = 0,
                 slots: int = 1, binary: Path | None = None, env: dict[str, str] | None = None,
                 **settings) -> None:
        self.settings = _settings(arena_bytes=arena.size, **settings)
        self._port = reserve_port("127.0.0.1", 0)
        self.port = self._port.getsockname()[1]
        offset, size = ArenaLayout(arena.size, slots).input_region(slot)
        values = self.settings.handover(FRONTEND)
        values["log_level"] = "info"
        handover = frontend_handover(
            self.settings, values, slot=slot, arena_fd=arena.fd, arena_bytes=arena.size,
            input_region=(offset, size), executor_socket=executor_socket,
            metrics_socket=socket_name("metrics"), grpc_port=self.port,
            extensions=server_extensions(False, cuda=False)).SerializeToString()
        super().__init__([str(binary or native.binary())], handover, (arena.fd,), env)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> int:
        try:
            return super().stop(timeout_s)
        finally:
            self._port.close()


class ExecutorProcess(_Child):
    """The real executor process on ``arena`` (``slots`` front-end slots), serving
    ``repository`` on ``socket``."""

    def __init__(self, arena: SharedArena, repository: Path, *, slots: int = 2,
                 frontend_pids: dict[int, int] | None = None, **settings) -> None:
        self.name = socket_name("executor")
        self.settings = _settings(arena_bytes=arena.size, model_repository=repository, **settings)
        values = self.settings.handover(EXECUTOR)
        values["log_level"] = "info"
        handover = {"role": EXECUTOR, "arena_fd": arena.fd, "arena_bytes": arena.size,
                    "slots": slots, "socket": self.name, "settings": values}
        if frontend_pids is not None:
            handover["frontend_pids"] = {str(slot): pid for slot, pid in frontend_pids.items()}
        super().__init__([sys.executable, "-m", "batchgate.server.executor.process"],
                         json.dumps(handover).encode(), (arena.fd,))
        self.wait_for("executor_ready", timeout_s=120)


class FakeFrontEnd(_Framed):
    """A front end played by the test: connected to an executor, ``slot`` said in its Hello."""

    def __init__(self, executor_socket: str, slot: int) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(wire.socket_address(executor_socket))
        super().__init__(sock, wire_pb2.ToFrontend)
        self.slot = slot
        self.write(wire_pb2.ToExecutor(hello=wire_pb2.Hello(slot=slot)))

    def read_until(self, done):
        """Read frames until ``done(frame)`` is true for one; that frame."""
        while True:
            frame = self.read()
            if done(frame):
                return frame
