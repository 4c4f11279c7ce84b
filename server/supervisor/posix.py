"""POSIX pieces of starting and watching child processes: the port reservation, the child's
death with its parent, its handover on standard input, and how it exited; and a serving
process's scheduling policy.

No torch, no grpc: the supervisor imports it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
from collections.abc import Callable

import structlog

from batchgate.batcher import scheduling
from batchgate.server.rules import messages

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, never-listening SO_REUSEPORT socket on ``(host, port)``: it holds the port.

    Front ends bind the same port with SO_REUSEPORT and listen; a socket that does not listen
    is not in the kernel's group that connections are spread over, so it never gets one.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` that gives the child PR_SET_PDEATHSIG=SIGKILL: it dies with the
    *thread* that forked it. Between fork and exec it runs only prctl and getppid: no lock
    that another thread could have held at fork time."""
    def preexec() -> None:  # in the child, between fork and exec
        if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(70)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(70)
    return preexec


def hand_over(proc: subprocess.Popen, handover: bytes) -> None:
    """Write the child's handover to its standard input and close it. A few KiB: the pipe's
    buffer takes it whole, whatever the child is doing. A child that exited at once (it could
    not start) breaks the pipe: its exit is reported as any other."""
    try:
        proc.stdin.write(handover)
    except BrokenPipeError:
        pass
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass


def exit_fields(returncode: int) -> dict:
    """A child's exit as log fields: ``exit_code``, or the ``signal`` that killed it."""
    if returncode >= 0:
        return {"exit_code": returncode}
    try:
        return {"signal": signal.Signals(-returncode).name}
    except ValueError:
        return {"signal": f"SIG{-returncode}"}


def describe_exit(how: dict) -> str:
    """``exit_fields`` in words."""
    return f"exit code {how['exit_code']}" if "exit_code" in how else f"killed by {how['signal']}"


def schedule_request_path(policy: str, model_cpus=None) -> None:
    """On a serving process's main thread, before it starts other threads: the request path's
    scheduling policy (``--request-scheduling``, ``batchgate.batcher.scheduling``) and, with
    ``model_cpus`` (``--model-cpus``), its CPUs apart from the model threads'; one warning
    where the system refuses either, and the server goes on as the process started."""
    why = scheduling.request_path(policy)
    if why is not None:
        log.warning("request_scheduling_not_applied", policy=policy, reason=why,
                    effect=messages.SCHEDULING_NOT_APPLIED_EFFECT())
    why = scheduling.split_cpus(model_cpus)
    if why is not None:
        log.warning("model_cpus_not_applied", model_cpus=list(model_cpus), reason=why,
                    effect=messages.CPUS_NOT_APPLIED_EFFECT())

