"""The `batchgate` console script: the server's command line, or one line saying what to install.

`pip install batchgate` is the SDK alone; `batchgate serve` and `batchgate bench` need the
`server` extra. Without it they exit 2 with one line instead of a traceback.
"""

from __future__ import annotations

import sys

# Import names of the distributions that only the `server` extra installs.
SERVER_EXTRA_MODULES = frozenset({"torch", "grpc_reflection", "prometheus_client", "structlog", "rich"})


def main(argv: list[str] | None = None) -> int:
    try:
        from batchgate.server.cli import main as server_main
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in SERVER_EXTRA_MODULES:
            raise
        print(f"batchgate: the server and the load generator need the server extra "
              f"({exc.name} is not installed): pip install 'batchgate[server]'", file=sys.stderr)
        return 2
    return server_main(argv)


if __name__ == "__main__":
    sys.exit(main())
