"""The SDK imports without torch and without the server's packages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter: this test process may already have imported torch or server/.
CHECK = """
import importlib.abc
import sys

# The server's packages, and the top-level names an older layout installed.
FORBIDDEN = ("torch", "batchgate.server", "batchgate.batcher", "server", "batcher")


def forbidden(name):
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


class Forbid(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if forbidden(name):
            raise ImportError(f"{name} is forbidden in this test")
        return None


sys.meta_path.insert(0, Forbid())
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the finder did not block torch: this test would prove nothing")

from batchgate import clients
from batchgate.clients import AsyncClient, BatchgateError, Client, InferResult, RetryPolicy  # noqa: F401

import batchgate
assert batchgate.Client is Client and batchgate.BatchgateError is BatchgateError

loaded = sorted(m for m in sys.modules if forbidden(m))
assert not loaded, loaded
client = Client("127.0.0.1:1")
client.close()
print("ok")
"""


def test_clients_import_without_torch():
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHECK)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_batchgate_exports_the_sdk_names():
    """`batchgate` lists the SDK's names without importing it (so `import batchgate` stays cheap);
    that list is the SDK's own `__all__`, and each name is the SDK's object."""
    import batchgate
    import batchgate.clients as sdk

    assert sorted(batchgate._SDK_NAMES) == sorted(sdk.__all__)
    assert all(getattr(batchgate, name) is getattr(sdk, name) for name in sdk.__all__)
