"""Shared fixtures: a real batchgate server on port 0 in every mode, serving the example models
plus the tests' own (``tests.support.models``); tests talk to it over real gRPC on loopback.

Fixtures only (and ``--fast``, the inner loop's selection: ``make test-fast``): the helpers they
use live in ``tests.support``, and so do those tests import.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest

from batchgate.protos import inference_pb2_grpc
from batchgate.bench.harness.server import RunningServer
from tests.support.models import Gate, write_test_repository
from tests.support.pki import make_pki
from tests.support.servers import SERVER_MODES, fast_mode, start_in_mode


def pytest_addoption(parser):
    parser.addoption(
        "--fast", action="store_true",
        help="the inner loop (make test-fast): leave out the tests marked slow, and run the "
             "tests of every server mode in one (native; single where it is not built)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    other_modes = {*SERVER_MODES, "native-asan"} - {fast_mode()}
    kept, left_out = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        in_other_mode = any(isinstance(value, str) and value in other_modes
                            for value in params.values())
        (left_out if in_other_mode or item.get_closest_marker("slow") else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def gate(tmp_path_factory) -> Gate:
    return Gate(tmp_path_factory.mktemp("gate"))


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory, gate) -> Path:
    return write_test_repository(tmp_path_factory.mktemp("models"), gate.dir)


@pytest.fixture(scope="session", params=SERVER_MODES)
def server(request, model_repository, gate) -> RunningServer:
    """The server in every mode: every test that uses it runs against each."""
    running = start_in_mode(request.param, model_repository, gate)
    yield running
    gate.open()
    running.stop()


@pytest.fixture(scope="module")
def channel(server):
    """A channel to ``server``, one per test module."""
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    """The KServe v2 stub on ``channel``."""
    return inference_pb2_grpc.GRPCInferenceServiceStub(channel)
