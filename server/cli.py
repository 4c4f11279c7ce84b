"""The ``batchgate`` command: ``serve`` (the default) runs the server, ``bench`` load-tests one.

``serve``'s flags are generated from ``batchgate.server.config.settings.Settings``, where each setting is
declared once with its help. They follow Triton's names and defaults where Triton has one
(``--grpc-port 8001``, ``--metrics-port 8002``, ``--model-repository``), so users' habits carry
over.

It serves in one of two modes (``--frontend``): ``native``, the supervisor with an executor
process and the native front end (C++), the way to serve from more than one process; or
``single``, one Python process that is its own gRPC edge, for debugging and for machines where
the native front end cannot be built. ``auto`` (the default) takes ``native`` where it is built,
else ``single`` with a warning that says why.

Bearer tokens have no flag of their own: a command line shows in ``ps`` to every user of the
machine, so they come from a file (``--admin-token-file``) or the environment
(``$BATCHGATE_ADMIN_TOKEN``), one or the other.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
from pathlib import Path

import structlog

from batchgate.batcher import gpu_env
from batchgate.server.supervisor import native_binary as native
from batchgate.server.logs import configure_logging
from batchgate.server.supervisor.posix import schedule_request_path
from batchgate.server.config.settings import TOKEN_ENV, Settings, check_devices
from batchgate.server.config.values import RETIRED_FLAGS
from batchgate.server.supervisor.supervisor import Supervisor

log = structlog.get_logger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags: one per ``Settings`` field that has a flag, plus the token files."""
    for field in dataclasses.fields(Settings):
        meta = field.metadata
        if meta["flag"] is None:
            continue
        flag = meta["flag"] or "--" + field.name.replace("_", "-")
        default = meta["default_text"]
        if default is None and field.default is not dataclasses.MISSING:
            default = field.default
        help_text = meta["help"]
        if meta["action"] is None:
            help_text += f" (default: {default})"
        kwargs = dict(dest=field.name, default=argparse.SUPPRESS, help=help_text)
        if meta["action"] is not None:
            parser.add_argument(flag, action=meta["action"], **kwargs)
        else:
            parser.add_argument(flag, type=_flag_type(meta["parse"]), choices=meta["choices"],
                                **kwargs)
    for role in TOKEN_ENV:
        parser.add_argument(f"--{role}-token-file", type=Path, default=None,
                            help=_token_help(role))
    for flag, message in RETIRED_FLAGS.items():
        parser.add_argument(flag, nargs="?", action=_Retired, message=message,
                            help=argparse.SUPPRESS)


class _Retired(argparse.Action):
    """A flag that is gone: refused with what replaces it (argparse would say only
    "unrecognized arguments")."""

    def __init__(self, option_strings, dest, message: str, **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = option_string if values is None else f"{option_string} {values}"
        raise argparse.ArgumentError(self, f"{self.message}, got {given}")


def _flag_type(parse):
    """argparse's ``type`` for a setting: a parser of our own says what is wrong in its
    message (argparse would say only "invalid value")."""
    if parse is None or parse in (int, float, Path):
        return parse or str

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def _token_help(role: str) -> str:
    field = next(f for f in dataclasses.fields(Settings) if f.name == f"{role}_token")
    what = field.metadata["help"].split("; None")[0]
    return f"file holding the {what} (or ${TOKEN_ENV[role]})"


def settings_from(args: argparse.Namespace) -> Settings:
    """The settings the flags ask for (those not given keep their declared defaults)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)
             if hasattr(args, f.name)}
    for role in TOKEN_ENV:
        given[f"{role}_token"] = read_token(role, getattr(args, f"{role}_token_file", None))
    return Settings(**given)


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


# What the one-process mode says when it starts: what it is for, and what serves otherwise.
SINGLE_PURPOSE = ("one Python process serves gRPC and runs the models: for debugging and for "
                  "machines where the native front end cannot be built; --frontend native "
                  "(make native) serves from an executor process behind the native front end")


def resolve_mode(settings: Settings) -> tuple[str, str | None]:
    """``(mode, why)``: "native" or "single"; ``why`` says why ``auto`` did not choose the
    native front end. ValueError when the native front end is asked for and not built, or when
    a setting is given that the mode does not act on."""
    mode, why = settings.frontend, None
    if mode == "auto":
        why = native.unavailable_reason()
        mode = "native" if why is None else "single"
    elif mode == "native":
        reason = native.unavailable_reason()
        if reason is not None:
            raise ValueError(f"--frontend native: {reason}")
    settings.check_mode(mode)
    return mode, why


async def serve(settings: Settings) -> None:
    from batchgate.server.frontend.app import Gateway  # torch and grpc: only the process that serves needs them

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
    # gRPC core writes its own diagnostics to stderr, in a format of its own (a TLS client
    # that fails its handshake is an INFO line): only errors, unless asked, so that a JSON log
    # stays JSON lines. Set before any process of the server loads gRPC; children inherit it.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    # The CUDA allocator's configuration and the device order, before anything can touch CUDA;
    # the supervisor's children inherit them.
    gpu_env.configure()
    if argv[:1] == ["bench"]:
        # Imported here: serve's supervisor must not load grpc (it forks), nor rich.
        from batchgate.bench.loadgen.cli import main as bench

        return bench(argv[1:], prog="batchgate bench")
    parser = argparse.ArgumentParser(prog="batchgate", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    add_serve_arguments(commands.add_parser("serve", help="run the gRPC server (the default)"))
    commands.add_parser("bench", add_help=False,
                        help="load-test a KServe v2 gRPC server (batchgate bench --help)")
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv.insert(0, "serve")
    args = parser.parse_args(argv)
    try:
        settings = settings_from(args)
        configure_logging(settings.log_level, settings.log_format)
        mode, why = resolve_mode(settings)
        supervisor = None
        if mode == "native":
            supervisor = Supervisor(settings)
        else:
            check_devices(settings)
    except ValueError as exc:
        parser.error(str(exc))
    if supervisor is not None:
        return supervisor.run()
    if why is not None:
        log.warning("native_front_end_unavailable", mode=mode, reason=why, purpose=SINGLE_PURPOSE)
    else:
        log.info("single_process_mode", mode=mode, purpose=SINGLE_PURPOSE)
    # Before the server's threads start: they inherit it, and model threads take SCHED_OTHER
    # back (batchgate.batcher.scheduling).
    schedule_request_path(settings.request_scheduling, settings.model_cpus)
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
