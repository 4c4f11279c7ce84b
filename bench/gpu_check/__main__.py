"""``python -m batchgate.bench.gpu_check`` (from the repository root, installed or not), or
``python bench/gpu_check``."""

import sys
from pathlib import Path

if not __package__:  # run as a folder: the repository root, not this folder, goes on the path
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from batchgate.bench.gpu_check.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
