"""Helpers shared by the tests and the benchmarks: the server harness (``harness``), the
poll-until helper (``polling``), model repositories written from a ``ModelConfig``
(``repository``), and the tests' own models, load and certificates.

Test modules import helpers from here, never from ``tests.conftest`` or from each other;
``conftest.py`` holds only fixtures. Benchmarks run from the repository root, so they import
``tests.support.harness`` too.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The repository's example models (``models/``).
EXAMPLE_MODELS = ROOT / "models"
