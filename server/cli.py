"""The ``batchgate`` command: ``serve`` (the default) runs the server, ``bench`` load-tests one.

Flags follow Triton's names and defaults where Triton has one (``--grpc-port 8001``,
``--metrics-port 8002``, ``--model-repository``), so users' habits carry over.

Bearer tokens have no flag of their own: a command line shows in ``ps`` to every user of the
machine, so they come from a file (``--admin-token-file``) or the environment
(``$BATCHGATE_ADMIN_TOKEN``), one or the other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from server.settings import DEFAULT_REPOSITORY, TOKEN_ENV, Settings
from server.logs import LOG_FORMATS, configure_logging
from server.supervisor import DEFAULT_ARENA_BYTES, Supervisor


def _serve_parser(parser: argparse.ArgumentParser) -> None:
    d = Settings.__dataclass_fields__
    parser.add_argument("--host", default=d["host"].default,
                        help="address to listen on (default: %(default)s)")
    parser.add_argument("--grpc-port", type=int, default=None,
                        help="gRPC port, 0 for any free port (default: $BATCHGATE_GRPC_PORT, "
                             "else 8001)")
    parser.add_argument("--metrics-port", type=int, default=d["metrics_port"].default,
                        help="Prometheus /metrics port, -1 to disable (default: %(default)s)")
    parser.add_argument("--model-repository", type=Path, default=None,
                        help="model repository folder (default: $BATCHGATE_MODEL_REPOSITORY, "
                             f"else the example repository {DEFAULT_REPOSITORY})")
    parser.add_argument("--max-message-bytes", type=int, default=d["max_message_bytes"].default,
                        help="largest gRPC message received or sent (default: %(default)s)")
    parser.add_argument("--max-request-bytes", type=int, default=None,
                        help="largest sum of one request's input tensor bytes; more is refused "
                             "with RESOURCE_EXHAUSTED (default: --max-message-bytes)")
    parser.add_argument("--max-tensor-elements", type=int,
                        default=d["max_tensor_elements"].default,
                        help="most elements one input tensor may have, from its shape, checked "
                             "before anything is allocated (default: %(default)s)")
    parser.add_argument("--tls-cert", type=Path, default=None,
                        help="PEM certificate chain: the gRPC port speaks TLS only "
                             "(with --tls-key)")
    parser.add_argument("--tls-key", type=Path, default=None,
                        help="PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", type=Path, default=None,
                        help="PEM CA certificates: clients must present a certificate they "
                             "signed (mutual TLS)")
    parser.add_argument("--admin-token-file", type=Path, default=None,
                        help="file holding the bearer token that load, unload and the "
                             f"repository index require (or ${TOKEN_ENV['admin']})")
    parser.add_argument("--infer-token-file", type=Path, default=None,
                        help="file holding the bearer token every other inference RPC "
                             "requires, except ServerLive/ServerReady and grpc.health.v1 "
                             f"(or ${TOKEN_ENV['infer']})")
    parser.add_argument("--drain-timeout-s", type=float, default=d["drain_timeout_s"].default,
                        help="on SIGTERM/SIGINT, how long queued requests may take to finish "
                             "(default: %(default)s)")
    parser.add_argument("--switch-interval-s", type=float,
                        default=d["switch_interval_s"].default,
                        help="Python's GIL switch interval; shorter keeps model threads fed "
                             "(default: %(default)s)")
    parser.add_argument("--no-gc-freeze", action="store_true",
                        help="do not freeze the garbage collector's view after loading")
    parser.add_argument("--no-reflection", action="store_true", help="disable server reflection")
    parser.add_argument("--frontends", default="auto",
                        help="front-end processes sharing the gRPC port, fed by one executor "
                             "process; 0 serves from one process; auto: 0 on a machine with "
                             "2 usable cores or fewer, else half the cores, at most 8 "
                             "(default: %(default)s)")
    parser.add_argument("--arena-bytes", type=int, default=DEFAULT_ARENA_BYTES,
                        help="size of the shared-memory arena between front ends and the "
                             "executor; pages are used only when touched (default: %(default)s)")
    add_device_pool_flags(parser)
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    parser.add_argument("--log-format", default="auto", choices=LOG_FORMATS,
                        help="json, console, or auto: console on a terminal, else json")


def add_device_pool_flags(parser: argparse.ArgumentParser) -> None:
    """The device memory pool's flags (batcher/memory.py); the executor process takes them too."""
    d = Settings.__dataclass_fields__
    parser.add_argument("--device-pool-bytes", type=int, default=d["device_pool_bytes"].default,
                        help="bytes of the memory pool reserved on each device models use, the "
                             "CPU's included (default: %(default)s)")
    parser.add_argument("--device-pool-fraction", type=float, default=None,
                        help="on a CUDA device, reserve this fraction (0-1] of its free memory "
                             "instead of --device-pool-bytes")
    parser.add_argument("--device-pool-permissive", action="store_true",
                        help="allocate what does not fit the pool outside it (counted in "
                             "batchgate_pool_fallbacks_total) instead of refusing it")


def device_pool_settings(args: argparse.Namespace) -> dict:
    return dict(device_pool_bytes=args.device_pool_bytes,
                device_pool_fraction=args.device_pool_fraction,
                device_pool_strict=not args.device_pool_permissive)


def default_frontends(cores: int) -> int:
    """Front ends for ``cores`` usable cores. On two cores, one process did as well as several
    (README, Performance): the executor and gRPC's work already fill both."""
    return 0 if cores <= 2 else min(8, cores // 2)


def parse_frontends(value: str) -> int:
    if value == "auto":
        return default_frontends(len(os.sched_getaffinity(0)))
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"--frontends must be 'auto' or an integer >= 0, got {value!r}")
    return count


def settings_from(args: argparse.Namespace) -> Settings:
    kwargs = dict(
        host=args.host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        max_message_bytes=args.max_message_bytes,
        max_request_bytes=args.max_request_bytes,
        max_tensor_elements=args.max_tensor_elements,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        admin_token=read_token("admin", args.admin_token_file),
        infer_token=read_token("infer", args.infer_token_file),
        drain_timeout_s=args.drain_timeout_s,
        switch_interval_s=args.switch_interval_s,
        gc_freeze=not args.no_gc_freeze,
        reflection=not args.no_reflection,
        **device_pool_settings(args),
    )
    if args.model_repository is not None:
        kwargs["model_repository"] = args.model_repository
    if args.grpc_port is not None:
        kwargs["grpc_port"] = args.grpc_port
    return Settings(**kwargs)


def read_token(role: str, path: Path | None) -> str | None:
    """The ``role`` token from ``path`` (surrounding white space dropped) or from the
    environment; None when neither is given."""
    env = TOKEN_ENV[role]
    from_env = os.environ.get(env)
    if path is None:
        return from_env or None
    if from_env:
        raise ValueError(f"give the {role} token by --{role}-token-file or ${env}, got both")
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"--{role}-token-file: cannot read {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError:  # its text would quote the file's bytes: the token
        raise ValueError(f"--{role}-token-file must be UTF-8 text, got {str(path)!r}") from None
    if not token:
        raise ValueError(f"--{role}-token-file must hold a token, got an empty file {str(path)!r}")
    return token


async def serve(settings: Settings) -> None:
    from server.app import Gateway  # torch and grpc: only the process that serves needs them

    gateway = Gateway(settings)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await gateway.start()
    await stopping.wait()
    await gateway.stop()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # Imported here: serve's supervisor must not load grpc (it forks), nor rich.
        from bench.loadgen.cli import main as bench

        return bench(argv[1:], prog="batchgate bench")
    parser = argparse.ArgumentParser(prog="batchgate", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    _serve_parser(commands.add_parser("serve", help="run the gRPC server (the default)"))
    commands.add_parser("bench", add_help=False,
                        help="load-test a KServe v2 gRPC server (batchgate bench --help)")
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "serve")
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        settings = settings_from(args)
        args.frontends = parse_frontends(args.frontends)
        supervisor = None
        if args.frontends > 0:
            supervisor = Supervisor(settings, frontends=args.frontends,
                                    arena_bytes=args.arena_bytes, log_level=args.log_level,
                                    log_format=args.log_format)
    except ValueError as exc:
        parser.error(str(exc))
    if supervisor is not None:
        return supervisor.run()
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
