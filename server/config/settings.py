"""Server settings, declared once: each field with its flag, its help and the processes it acts in.

``Settings`` is the only declaration. ``batchgate serve``'s flags are generated from it
(``add_arguments`` / ``from_arguments``), so a flag and its setting cannot drift apart. In
multi-process mode the supervisor validates and resolves the settings once and hands every
child what it acts on (``handover``) as JSON on its standard input; children — the executor
and the native front end — never parse flags of their own. So a setting that a process does
not act on never reaches it, a setting the chosen mode does not act on at all is refused
(``check_mode``), and a flag that is gone is refused naming what replaced it
(``RETIRED_FLAGS``, in ``server/config/values.py`` with how a flag's text is parsed), never silently accepted.

Importable without torch or grpc (the supervisor uses it). Tokens are values here, never paths
or flags: the CLI reads them from a file or the environment so that they do not show in
``ps``, and ``repr`` leaves them out so that they never reach a log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from batchgate.server.config.values import (
    RETIRED_FRONTENDS,
    cpu_list,
    cpus_text,
    frontend_mode,
    optional_port,
    optional_seconds,
    setting,
    usable_cpus,
)
from batchgate.server.rules import messages

DEFAULT_REPOSITORY = Path(__file__).resolve().parents[2] / "models"
MIN_DEVICE_POOL_BYTES = 4096  # batchgate.batcher.memory.MIN_CAP_BYTES (no torch here)
DEFAULT_ARENA_BYTES = 1 << 30
DEFAULT_GRPC_MAX_THREADS = 16
# gRPC's time arguments are milliseconds in a signed 32-bit integer (~24.8 days).
MAX_GRPC_SECONDS = (2**31 - 1) / 1000
MIN_TOKEN_CHARS = 16
# Where the CLI reads each bearer token from (besides a file).
TOKEN_ENV = {"admin": "BATCHGATE_ADMIN_TOKEN", "infer": "BATCHGATE_INFER_TOKEN"}
# What each TLS file must hold. gRPC reports a file it cannot use only as "failed to bind".
PEM_MARKERS = {
    "tls_cert": b"-----BEGIN CERTIFICATE-----",
    "tls_key": b"PRIVATE KEY-----",
    "tls_client_ca": b"-----BEGIN CERTIFICATE-----",
}
# native: the supervisor, an executor process and the native front end; single: one Python
# process that is its own gRPC edge (debugging, machines where the native one cannot be built).
FRONTENDS = ("auto", "native", "single")
LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
REQUEST_SCHEDULING = ("batch", "normal")  # batchgate.batcher.scheduling.POLICIES (no torch here)

# The processes of a multi-process server; a single-process server is all three at once.
SUPERVISOR = "supervisor"
FRONTEND = "frontend"
EXECUTOR = "executor"
ROLES = (SUPERVISOR, FRONTEND, EXECUTOR)


ALL = ROLES
SERVING = (FRONTEND, EXECUTOR)


@dataclasses.dataclass
class Settings:
    """Server settings; every one with a flag is a ``batchgate serve`` flag."""

    # -- the network ---------------------------------------------------------------------------
    host: str = setting("0.0.0.0", roles=(SUPERVISOR, FRONTEND),
                        help="address to listen on")
    grpc_port: int = setting(
        8001, env="BATCHGATE_GRPC_PORT", parse=int, roles=(SUPERVISOR,),
        help="gRPC port, 0 for any free port", default_text="$BATCHGATE_GRPC_PORT, else 8001")
    metrics_port: int | None = setting(
        8002, parse=optional_port, roles=(SUPERVISOR,), default_text="8002",
        help="Prometheus /metrics port, -1 to disable")
    max_message_bytes: int = setting(
        64 * 1024 * 1024, parse=int, roles=(FRONTEND,),
        help="largest gRPC message received or sent")
    max_request_bytes: int | None = setting(
        None, parse=int, roles=(FRONTEND,), default_text="--max-message-bytes",
        help="largest sum of one request's input tensor bytes; more is refused with "
             "RESOURCE_EXHAUSTED")
    max_tensor_elements: int = setting(
        1 << 26, parse=int, roles=(FRONTEND,),
        help="most elements one input tensor may have, from its shape (a zero dimension "
             "counts as one), checked before anything is allocated")
    # What one request's wire bytes may hold, counted before it is parsed
    # (server/rules/request_limits.py): a repeated field costs far more parsed than on the wire.
    max_tensor_dimensions: int = setting(
        32, parse=int, roles=(FRONTEND,),
        help="most dimensions one tensor's shape may have in a request")
    max_request_inputs: int = setting(
        1024, parse=int, roles=(FRONTEND,),
        help="most inputs (and raw_input_contents entries) one request may have")
    max_request_outputs: int = setting(
        1024, parse=int, roles=(FRONTEND,), help="most outputs one request may ask for")
    max_request_parameters: int = setting(
        64, parse=int, roles=(FRONTEND,),
        help="most entries of any one parameters map of a request (its own, each tensor's)")
    max_request_string_elements: int = setting(
        65536, parse=int, roles=(FRONTEND,),
        help="most contents.bytes_contents entries one request may have, each held apart in "
             "memory (BYTES tensors in raw_input_contents are not limited by it); 0 refuses "
             "them")
    max_request_name_bytes: int = setting(
        1024, parse=int, roles=(FRONTEND,),
        help="longest model name, version, id, tensor name or datatype, parameter key or "
             "string value in a request, in bytes")
    max_request_unknown_fields: int = setting(
        64, parse=int, roles=(FRONTEND,),
        help="most fields of a request this server does not know (kept, not read, when "
             "parsed); 0 refuses any")
    reflection: bool = setting(True, flag="--no-reflection", action="store_false",
                               roles=(FRONTEND,), help="disable server reflection")

    # -- connections ---------------------------------------------------------------------------
    # What one front-end process allows all its clients together (gRPC's own server arguments,
    # server/rules/connections.py), so that no client holds streams, memory or idle connections
    # without bound.
    max_concurrent_streams: int = setting(
        256, parse=int, roles=(FRONTEND,),
        help="most calls one client connection may have open at once (HTTP/2 streams); a "
             "client's further calls wait for one to end")
    grpc_memory_bytes: int | None = setting(
        None, parse=int, roles=(FRONTEND,), default_text="a quarter of the machine's memory",
        help="with the native front end: the memory gRPC may hold for connections and "
             "messages in flight (its ResourceQuota); near it, gRPC slows its reads "
             "and reclaims buffers")
    grpc_max_threads: int | None = setting(
        None, parse=int, roles=(FRONTEND,), default_text=str(DEFAULT_GRPC_MAX_THREADS),
        help="with the native front end: most threads gRPC's synchronous services (server "
             "reflection) may run (its ResourceQuota)")
    grpc_keepalive_time_s: float = setting(
        60.0, parse=float, roles=(FRONTEND,),
        help="seconds between the server's pings on a connection with calls open, to find "
             "clients that vanished")
    grpc_keepalive_timeout_s: float = setting(
        20.0, parse=float, roles=(FRONTEND,),
        help="seconds a ping waits for its answer before the connection is closed")
    grpc_min_ping_interval_s: float = setting(
        10.0, parse=float, roles=(FRONTEND,),
        help="least seconds between a client's pings when no data flows; each faster ping "
             "is a strike")
    grpc_max_ping_strikes: int = setting(
        2, parse=int, roles=(FRONTEND,),
        help="pings too soon after another that a connection may send before it is closed "
             "(GOAWAY too_many_pings); 0: any number")
    grpc_max_connection_idle_s: float | None = setting(
        3600.0, parse=optional_seconds, roles=(FRONTEND,),
        help="seconds a connection with no call open is kept before the server closes it "
             "gracefully (GOAWAY); -1: kept")
    grpc_max_connection_age_s: float | None = setting(
        1800.0, parse=optional_seconds, roles=(FRONTEND,),
        help="seconds after which a connection is told to go (GOAWAY, so clients reconnect "
             "and spread over replicas); its open calls go on; -1: never")
    grpc_max_connection_age_grace_s: float | None = setting(
        None, parse=optional_seconds, roles=(FRONTEND,), default_text="-1",
        help="seconds the calls of a connection told to go may still take before it is "
             "closed; -1: until they end (long streams are not cut)")
    max_stream_backlog_bytes: int = setting(
        64 * 1024 * 1024, parse=int, roles=(FRONTEND,),
        help="reply bytes a ModelStreamInfer stream may hold for a client that reads slowly; "
             "past them the server stops reading that stream's requests until replies drain")

    # -- security ------------------------------------------------------------------------------
    tls_cert: Path | None = setting(
        None, parse=Path, roles=(FRONTEND,),
        help="PEM certificate chain: the gRPC port speaks TLS only (with --tls-key)")
    tls_key: Path | None = setting(None, parse=Path, roles=(FRONTEND,),
                                   help="PEM private key of --tls-cert")
    tls_client_ca: Path | None = setting(
        None, parse=Path, roles=(FRONTEND,),
        help="PEM CA certificates: clients must present a certificate they signed (mutual TLS)")
    admin_token: str | None = setting(
        None, flag=None, repr=False, roles=(FRONTEND,),
        help="bearer token the repository RPCs (load, unload, index) require; None: open "
             "(--admin-token-file or $BATCHGATE_ADMIN_TOKEN)")
    infer_token: str | None = setting(
        None, flag=None, repr=False, roles=(FRONTEND,),
        help="bearer token every other inference RPC requires except ServerLive/ServerReady "
             "and grpc.health.v1; None: open (--infer-token-file or $BATCHGATE_INFER_TOKEN)")

    shared_memory: bool = setting(
        False, action="store_true", roles=SERVING,
        help="serve Triton's system and CUDA shared-memory extensions: local clients register "
             "regions (files in /dev/shm, CUDA IPC handles) and pass tensors through them; for "
             "trusted local clients only (docs/operations.md, Shared memory)")

    # -- the models ----------------------------------------------------------------------------
    model_repository: Path = setting(
        DEFAULT_REPOSITORY, env="BATCHGATE_MODEL_REPOSITORY", parse=Path, roles=(EXECUTOR,),
        default_text=f"$BATCHGATE_MODEL_REPOSITORY, else the example repository "
                     f"{DEFAULT_REPOSITORY}",
        help="model repository folder")
    max_load_files_bytes: int = setting(
        64 * 1024 * 1024, parse=int, roles=(EXECUTOR,),
        help="largest sum of the file: contents one RepositoryModelLoad may bring; 0 refuses "
             "loads with file: parameters")
    device_pool_bytes: int | None = setting(
        None, parse=int, roles=(EXECUTOR,), default_text="no cap",
        help="the most bytes the memory pool may hold on each device, the CPU's included; the "
             "pool holds only its loaded models' plans and staged inputs, reserved per model "
             "as it loads")
    device_pool_fraction: float | None = setting(
        None, parse=float, roles=(EXECUTOR,), default_text="no cap",
        help="on a CUDA device, the most the memory pool may hold as a fraction (0-1] of the "
             "device's total memory (with --device-pool-bytes too, the smaller applies)")
    device_pool_strict: bool = setting(
        True, flag="--device-pool-permissive", action="store_false", roles=(EXECUTOR,),
        help="serve a model whose plan passes the pool's cap, and staged inputs that do not "
             "fit, outside the pool (counted in batchgate_pool_fallbacks_total) instead of "
             "refusing the model")

    # -- processes -----------------------------------------------------------------------------
    frontend: str = setting(
        "auto", parse=frontend_mode, choices=FRONTENDS, roles=(SUPERVISOR,),
        help="the gRPC edge: native (the C++ front end, one process using every core, over an "
             "executor process), single (one Python process, for debugging or where the native "
             "one cannot be built), or auto: native where it is built, else single with a warning")
    frontend_threads: int = setting(
        0, parse=int, roles=(FRONTEND,), default_text="the usable cores",
        help="with the native front end: gRPC threads, each with its own completion queue")
    arena_bytes: int | None = setting(
        None, parse=int, roles=(SUPERVISOR,), default_text=str(DEFAULT_ARENA_BYTES),
        help="size of the shared-memory arena between the native front end and the executor "
             "(--frontend native); pages are used only when touched")
    drain_timeout_s: float = setting(
        30.0, parse=float, roles=ALL,
        help="on SIGTERM/SIGINT, how long queued requests may take to finish")
    request_scheduling: str = setting(
        "batch", choices=REQUEST_SCHEDULING, roles=SERVING,
        help="Linux scheduling policy of the request path's threads (the front end, the "
             "executor's event loop): batch (SCHED_BATCH) does not preempt a running model "
             "thread when it wakes, so model threads keep their cores under load; normal: "
             "as the process started (SCHED_OTHER)")
    model_cpus: tuple[int, ...] | None = setting(
        None, parse=cpu_list, roles=SERVING, default_text="any",
        help="CPUs the model threads run on, as a list such as 1 or 2-7,9 (their intra-op "
             "threads too, by default no more of them than those CPUs); the request path "
             "(the front end, the executor's event loop) then runs on the server's other CPUs, "
             "so the two do not share cores and caches")
    switch_interval_s: float = setting(
        0.0005, parse=float, roles=(EXECUTOR,),
        help="Python's GIL switch interval; shorter keeps model threads fed")
    gc_freeze: bool = setting(
        True, flag="--no-gc-freeze", action="store_false", roles=(EXECUTOR,),
        help="do not freeze the garbage collector's view after loading")
    log_level: str = setting("info", choices=LOG_LEVELS, roles=ALL,
                             help="the least severe log lines written")
    log_format: str = setting("auto", choices=LOG_FORMATS, roles=(SUPERVISOR,),
                              help="json, console, or auto: console on a terminal, else json")

    def __post_init__(self) -> None:
        self.model_repository = Path(self.model_repository)
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"grpc_port must lie in 0..65535, got {self.grpc_port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must lie in 0..65535, got {self.metrics_port}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_tensor_elements < 1:
            raise ValueError(f"max_tensor_elements must be >= 1, got {self.max_tensor_elements}")
        for name in ("max_tensor_dimensions", "max_request_inputs", "max_request_outputs",
                     "max_request_parameters", "max_request_name_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_request_string_elements", "max_request_unknown_fields"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: none), got {getattr(self, name)}")
        self._check_connections()
        if self.max_load_files_bytes < 0:
            raise ValueError(
                f"max_load_files_bytes must be >= 0 (0: no file: loads), "
                f"got {self.max_load_files_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.switch_interval_s <= 0:
            raise ValueError(f"switch_interval_s must be > 0, got {self.switch_interval_s}")
        if not self.model_repository.is_dir():
            raise ValueError(f"model_repository must be a folder, got {str(self.model_repository)!r}")
        if self.frontend in RETIRED_FRONTENDS:
            raise ValueError(f"{RETIRED_FRONTENDS[self.frontend]}, got frontend {self.frontend!r}")
        for name, choices in (("frontend", FRONTENDS), ("log_format", LOG_FORMATS),
                              ("log_level", LOG_LEVELS),
                              ("request_scheduling", REQUEST_SCHEDULING)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, "
                                 f"got {getattr(self, name)!r}")
        if self.frontend_threads < 0:
            raise ValueError(f"frontend_threads must be >= 0 (0: the usable cores), "
                             f"got {self.frontend_threads}")
        if self.arena_bytes is not None and self.arena_bytes <= 0:
            raise ValueError(f"arena_bytes must be > 0, got {self.arena_bytes}")
        self._check_model_cpus()
        self._check_device_pool()
        self._check_tls()
        for name in ("admin_token", "infer_token"):
            _check_token(name, getattr(self, name))
        if self.admin_token is not None and self.admin_token == self.infer_token:
            raise ValueError("admin_token and infer_token must differ, got the same token twice")

    def _check_model_cpus(self) -> None:
        if self.model_cpus is None:
            return
        self.model_cpus = (cpu_list(self.model_cpus) if isinstance(self.model_cpus, str)
                           else tuple(sorted(set(self.model_cpus))))
        usable = usable_cpus()
        if usable is None:
            raise ValueError("model_cpus needs a system that sets CPU affinity (Linux), got "
                             f"--model-cpus {cpus_text(self.model_cpus)}")
        outside = sorted(set(self.model_cpus) - usable)
        if outside or not self.model_cpus:
            raise ValueError(
                f"model_cpus must be CPUs this server may run on ({cpus_text(usable)}), got "
                f"--model-cpus {cpus_text(self.model_cpus)}")
        if not usable - set(self.model_cpus):
            raise ValueError(
                "model_cpus must leave the request path at least one of the CPUs this server "
                f"may run on ({cpus_text(usable)}), got --model-cpus "
                f"{cpus_text(self.model_cpus)}")

    def _check_connections(self) -> None:
        if self.max_concurrent_streams < 1:
            raise ValueError(
                f"max_concurrent_streams must be >= 1, got {self.max_concurrent_streams}")
        if self.grpc_memory_bytes is not None and self.grpc_memory_bytes < self.max_message_bytes:
            raise ValueError(
                f"grpc_memory_bytes must be >= max_message_bytes ({self.max_message_bytes}: gRPC "
                f"could never hold one message), got {self.grpc_memory_bytes}")
        if self.grpc_max_threads is not None and self.grpc_max_threads < 2:
            raise ValueError(f"grpc_max_threads must be >= 2 (a poller and a handler), "
                             f"got {self.grpc_max_threads}")
        for name in ("grpc_keepalive_time_s", "grpc_keepalive_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= MAX_GRPC_SECONDS:
                raise ValueError(f"{name} must lie in (0, {MAX_GRPC_SECONDS:g}], got {value}")
        for name in ("grpc_min_ping_interval_s", "grpc_max_connection_idle_s",
                     "grpc_max_connection_age_s", "grpc_max_connection_age_grace_s"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_GRPC_SECONDS:
                raise ValueError(f"{name} must lie in [0, {MAX_GRPC_SECONDS:g}], got {value}")
        if self.grpc_max_ping_strikes < 0:
            raise ValueError(f"grpc_max_ping_strikes must be >= 0 (0: any number), "
                             f"got {self.grpc_max_ping_strikes}")
        if self.max_stream_backlog_bytes < 1:
            raise ValueError(f"max_stream_backlog_bytes must be >= 1, "
                             f"got {self.max_stream_backlog_bytes}")

    def _check_device_pool(self) -> None:
        if self.device_pool_bytes is not None and self.device_pool_bytes < MIN_DEVICE_POOL_BYTES:
            raise ValueError(f"device_pool_bytes must be >= {MIN_DEVICE_POOL_BYTES} (or unset: "
                             f"no cap), got {self.device_pool_bytes}")
        fraction = self.device_pool_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"device_pool_fraction must lie in (0, 1], got {fraction}")

    def _check_tls(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is None:
                continue
            path = Path(path)
            setattr(self, name, path)
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise ValueError(
                    f"{name} must be a readable file, got {str(path)!r} ({exc.strerror})"
                ) from None
            if PEM_MARKERS[name] not in data:
                raise ValueError(
                    f"{name} must be a PEM file ({PEM_MARKERS[name].decode()}), "
                    f"got {str(path)!r}"
                )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "tls_cert and tls_key go together, got only "
                + ("tls_cert" if self.tls_key is None else "tls_key")
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(f"tls_client_ca {messages.TLS_CLIENT_CA_NEEDS()}, got neither")

    # -- derived -------------------------------------------------------------------------------

    @property
    def request_bytes_limit(self) -> int:
        """``max_request_bytes``, or ``max_message_bytes`` when it is not set."""
        return self.max_message_bytes if self.max_request_bytes is None else self.max_request_bytes

    @property
    def grpc_memory_limit(self) -> int:
        """``grpc_memory_bytes``, or a quarter of the machine's memory (at least four messages)."""
        if self.grpc_memory_bytes is not None:
            return self.grpc_memory_bytes
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(physical // 4, 4 * self.max_message_bytes)

    @property
    def grpc_threads_limit(self) -> int:
        """``grpc_max_threads``, or its default."""
        return DEFAULT_GRPC_MAX_THREADS if self.grpc_max_threads is None else self.grpc_max_threads

    @property
    def arena_size(self) -> int:
        return DEFAULT_ARENA_BYTES if self.arena_bytes is None else self.arena_bytes

    def security(self) -> dict[str, object]:
        """What the ``listening`` log line says of TLS and tokens (whether set, never what)."""
        tls = "mutual" if self.tls_client_ca else "on" if self.tls_cert else "off"
        return {"tls": tls, "admin_token": self.admin_token is not None,
                "infer_token": self.infer_token is not None}

    def check_mode(self, mode: str) -> None:
        """Refuse the settings that the resolved ``mode`` ("native" or "single") does not act
        on: ValueError saying which and why."""
        if mode != "native" and self.frontend_threads:
            raise ValueError(
                "--frontend-threads sizes the native front end's thread pool, got "
                f"--frontend-threads {self.frontend_threads} with --frontend single")
        for name in ("grpc_memory_bytes", "grpc_max_threads"):
            if mode != "native" and getattr(self, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} sets the native front end's gRPC ResourceQuota, which grpcio (one "
                    f"process, --frontend single) does not offer, got {flag} {getattr(self, name)}")
        if mode != "native" and self.arena_bytes is not None:
            raise ValueError(
                "--arena-bytes sizes the shared memory between processes; one process "
                f"(--frontend single) has none, got --arena-bytes {self.arena_bytes}")

    # -- the handover to a child process -------------------------------------------------------

    def handover(self, role: str) -> dict[str, Any]:
        """What a ``role`` process acts on, as JSON values: paths absolute, ``max_request_bytes``
        resolved. The rest of the settings never reach it."""
        values = {}
        for field in dataclasses.fields(self):
            if role not in field.metadata["roles"]:
                continue
            value = getattr(self, field.name)
            if isinstance(value, Path):
                value = str(value.resolve())
            values[field.name] = value
        if "max_request_bytes" in values:
            values["max_request_bytes"] = self.request_bytes_limit
        if "grpc_memory_bytes" in values:
            values["grpc_memory_bytes"] = self.grpc_memory_limit
            values["grpc_max_threads"] = self.grpc_threads_limit
        return values

    @classmethod
    def handed_over(cls, values: dict[str, Any]) -> Settings:
        """A child's settings from its ``handover``: validated by the supervisor already, so
        not checked again (a front end never looks at the model repository, for one). Fields
        that were not handed over keep their declared defaults and are not read."""
        settings = object.__new__(cls)
        for field in dataclasses.fields(cls):
            if field.name in values:
                value = values[field.name]
                parse = field.metadata["parse"]
                if value is not None and parse is Path:
                    value = Path(value)
            elif field.default is not dataclasses.MISSING:
                value = field.default
            else:
                value = None
            setattr(settings, field.name, value)
        return settings


def check_devices(settings: Settings) -> None:
    """Refuse, in the process that holds the models, the settings its devices cannot act on
    (ValueError saying why). It imports torch: only a process that serves calls it."""
    if settings.device_pool_fraction is not None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                "--device-pool-fraction caps the pools of CUDA devices, and this machine has "
                f"none; give --device-pool-bytes, got --device-pool-fraction "
                f"{settings.device_pool_fraction}")


def fields_for(role: str) -> list[str]:
    """The names of the settings a ``role`` process acts on."""
    return [f.name for f in dataclasses.fields(Settings) if role in f.metadata["roles"]]


def _check_token(name: str, token: str | None) -> None:
    """A bearer token travels in a header: visible ASCII, no spaces (RFC 6750). The message
    says what is wrong with it, never the token itself."""
    if token is None:
        return
    if not isinstance(token, str):
        raise ValueError(f"{name} must be a string, got {type(token).__name__}")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{name} must have at least {MIN_TOKEN_CHARS} characters (e.g. the output of "
            f"'openssl rand -hex 32'), got {len(token)}"
        )
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(
            f"{name} must be visible ASCII characters without spaces, got {len(token)} "
            "characters that are not all such"
        )


def read_handover(stream=None) -> dict[str, Any]:
    """A child's handover: the JSON object the supervisor wrote on its standard input."""
    stream = stream if stream is not None else sys.stdin.buffer
    return json.loads(stream.read())
