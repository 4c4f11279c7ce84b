"""Where the native front end's binary is, and why it cannot be used when it cannot.

``scripts/build-native.sh`` (run by ``make serve`` and ``make test``) builds it from
``server/native/`` into ``build/native/batchgate-frontend``; ``$BATCHGATE_NATIVE_FRONTEND``
names another build (the sanitizer build in CI). No torch, no grpc: the supervisor imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "BATCHGATE_NATIVE_FRONTEND"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BINARY = ROOT / "build" / "native" / "batchgate-frontend"


def binary() -> Path:
    """The native front end's executable (which may not exist)."""
    return Path(os.environ.get(ENV_VAR) or DEFAULT_BINARY)


def unavailable_reason() -> str | None:
    """None when the native front end can be started; else why not, for a person."""
    path = binary()
    if not path.is_file():
        return (f"the native front end is not built ({path} does not exist; "
                "scripts/build-native.sh builds it)")
    if not os.access(path, os.X_OK):
        return f"the native front end {path} is not executable"
    return None
