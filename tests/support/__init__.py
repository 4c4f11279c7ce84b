"""The tests' own helpers. Test modules import helpers from here or from
``batchgate.bench.harness`` (what tests share with the benchmarks: the server harness, model
folders written from a ``ModelConfig``, ``/metrics`` parsed, peak memory from ``/proc``), never
from ``tests.conftest`` or from each other; ``conftest.py`` holds only fixtures. Nothing outside
``tests/`` imports this package.

- ``servers``: the tests' servers, the harness with the tests' defaults, in every mode;
- ``polling``: the one poll-until helper (``poll``, ``apoll``);
- ``models``: the tests' own models and the ``Gate`` that holds them;
- ``load``: closed-loop SDK load from threads, every answer checked;
- ``batching``: the batch loop's fake model, spec and requests;
- ``fake_server``: a fake KServe v2 server for the SDK's tests;
- ``messages``: v2 requests built and read by hand;
- ``regions``: the names of the shared-memory regions the tests' clients make;
- ``pki``: throwaway certificates; ``tools``: outside tools and whether they run here.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The repository's example models (``models/``).
EXAMPLE_MODELS = ROOT / "models"
