"""``python -m bench.loadgen``: the same command as ``batchgate bench``."""

import sys

from bench.loadgen.cli import main

sys.exit(main(prog="python -m bench.loadgen"))
