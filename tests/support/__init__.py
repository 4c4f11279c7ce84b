"""Helpers shared by the tests and the benchmarks. Test modules import helpers from here, never
from ``tests.conftest`` or from each other; ``conftest.py`` holds only fixtures. Benchmarks run
from the repository root and import ``harness`` and ``repository`` too.

- ``harness``: the one server harness (a server process in any mode, or one on a thread);
- ``servers``: the tests' servers, the harness with the tests' defaults, in every mode;
- ``polling``: the one poll-until helper (``poll``, ``apoll``);
- ``repository``: model folders written from a ``ModelConfig``;
- ``models``: the tests' own models and the ``Gate`` that holds them;
- ``metrics``: ``/metrics`` read and parsed;
- ``load``: closed-loop SDK load from threads, every answer checked;
- ``batching``: the batch loop's fake model, spec and requests;
- ``fake_server``: a fake KServe v2 server for the SDK's tests;
- ``messages``: v2 requests built and read by hand;
- ``pki``: throwaway certificates; ``tools``: outside tools and whether they run here.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The repository's example models (``models/``).
EXAMPLE_MODELS = ROOT / "models"
