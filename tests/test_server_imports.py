"""The server does not import the load generator: ``bench`` loads only for ``batchgate bench``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: this test process may already have imported bench.
CHECK = """
import contextlib
import importlib
import io
import pkgutil
import sys

from batchgate import server
from batchgate.server import cli


def bench_modules():
    return sorted(m for m in sys.modules
                  if m == "batchgate.bench" or m.startswith("batchgate.bench."))


modules = sorted(info.name for info in pkgutil.walk_packages(server.__path__, "batchgate.server."))
assert "batchgate.server.cli" in modules and "batchgate.server.supervisor.supervisor" in modules, modules
for name in modules:
    importlib.import_module(name)
assert not bench_modules(), bench_modules()

# The serve command's argument parsing loads nothing of bench either.
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    cli.main(["serve", "--help"])
assert not bench_modules(), bench_modules()

# And the check sees bench when it is there: the bench command's path loads it.
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    cli.main(["bench", "--help"])
assert "batchgate.bench.loadgen.cli" in bench_modules(), bench_modules()
print("ok")
"""


def test_the_server_imports_no_bench_module():
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHECK)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# The engine knows nothing of the server or of gRPC: importing every batcher module loads
# neither (a fresh interpreter, so nothing is loaded before).
ENGINE_CHECK = """
import importlib
import pkgutil
import sys

from batchgate import batcher

modules = sorted(info.name for info in pkgutil.walk_packages(batcher.__path__, "batchgate.batcher."))
assert "batchgate.batcher.pool" in modules and "batchgate.batcher.model" in modules, modules
for name in modules:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.startswith(("batchgate.server", "grpc")))
assert not loaded, loaded
print("ok")
"""


def test_the_batcher_imports_neither_the_server_nor_grpc():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(ENGINE_CHECK)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
