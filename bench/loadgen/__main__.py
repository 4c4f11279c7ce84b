"""``python -m batchgate.bench.loadgen``: the same command as ``batchgate bench``."""

import sys

from batchgate.bench.loadgen.cli import main

sys.exit(main(prog="python -m batchgate.bench.loadgen"))
