"""Failure isolation of the multi-process mode, with real processes under load.

Each test runs its own supervisor (the shared ``server`` fixture must not be killed) on the
example ``mlp`` model, with closed-loop SDK clients on threads, bounded in count and time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import numpy as np
import pytest

from clients import BatchgateError, Client, RetryPolicy
from tests.conftest import poll, reference, start_multiprocess_server


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class Load:
    """Closed-loop clients on threads: every answer checked, failures counted by status."""

    def __init__(self, address: str, clients: int = 8, retry: RetryPolicy | None = None) -> None:
        self.address = address
        self.retry = retry or RetryPolicy(max_attempts=1)
        self.ok = 0
        self.wrong = 0
        self.failures: Counter = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._x = np.random.default_rng(0).standard_normal((1, 512), dtype=np.float32)
        self._expected = reference("mlp", self._x)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        # A connection of its own (gRPC shares one per target otherwise), so SO_REUSEPORT
        # spreads the clients over the front ends.
        with Client(self.address, timeout_s=10, retry=self.retry,
                    options=[("grpc.use_local_subchannel_pool", 1)]) as client:
            deadline = time.monotonic() + 120  # bounded whatever happens
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    out = client.infer("mlp", {"INPUT__0": self._x})["OUTPUT__0"]
                except BatchgateError as exc:
                    with self._lock:
                        self.failures[exc.code] += 1
                    continue
                good = np.allclose(out, self._expected, rtol=1e-4, atol=1e-5)
                with self._lock:
                    self.ok += 1 if good else 0
                    self.wrong += 0 if good else 1

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def answered(self) -> int:
        with self._lock:
            return self.ok


@pytest.fixture
def mlp_only(tmp_path):
    import shutil

    from tests.conftest import EXAMPLE_MODELS

    shutil.copytree(EXAMPLE_MODELS / "mlp", tmp_path / "mlp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def pids(server, role: str) -> dict:
    return server.supervisor.pids(role)


def test_killed_front_end_loses_only_its_requests_and_comes_back(mlp_only):
    before_shm = dev_shm()
    server = start_multiprocess_server(mlp_only, frontends=2)
    try:
        old = pids(server, "frontend")
        # The SDK's retries take a failed request to another front end.
        retry = RetryPolicy(max_attempts=10, initial_backoff_s=0.02, max_backoff_s=0.5)
        with Load(server.address, retry=retry) as load:
            poll(lambda: load.answered() > 50, what="load running")
            os.kill(old[0], signal.SIGKILL)
            poll(lambda: pids(server, "frontend").get(0) not in (None, old[0]), 60,
                 "front end 0 restarted")
            assert pids(server, "frontend")[1] == old[1], "the other front end was disturbed"
            served = load.answered()
            poll(lambda: load.answered() > served + 50, what="serving after the restart")
        print(f"front-end kill: ok={load.ok} failures={dict(load.failures)}")
        # Every arena block came back: the killed front end's outputs and inputs included.
        poll(lambda: server.metric("batchgate_arena_bytes_in_use") == 0, 30, "arena empty")
        assert load.wrong == 0
        # What the killed process had in flight failed UNAVAILABLE and was retried elsewhere.
        assert not load.failures
    finally:
        server.stop()
    assert dev_shm() == before_shm


def test_killed_executor_answers_unavailable_then_serves_again(mlp_only):
    before_shm = dev_shm()
    server = start_multiprocess_server(mlp_only, frontends=2)
    try:
        old = pids(server, "executor")[None]
        with Load(server.address) as load, grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = lambda: health.Check(health_pb2.HealthCheckRequest(service="")).status
            poll(lambda: load.answered() > 50, what="load running")
            os.kill(old, signal.SIGKILL)
            # While no executor runs, the front ends say so (the one this channel reaches).
            poll(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 60,
                 "health NOT_SERVING while the executor is down")
            poll(lambda: pids(server, "executor").get(None) not in (None, old), 120,
                 "executor restarted")
            poll(lambda: status() == health_pb2.HealthCheckResponse.SERVING, 60,
                 "health SERVING again")
            with Client(server.address, timeout_s=10) as client:
                poll(lambda: client.model_ready("mlp"), 60, "mlp READY again")
            served = load.answered()
            poll(lambda: load.answered() > served + 50, 60, "serving after the restart")
        print(f"executor kill: ok={load.ok} failures={dict(load.failures)}")
        poll(lambda: server.metric("batchgate_arena_bytes_in_use") == 0, 30, "arena empty")
        assert load.wrong == 0
        assert load.failures[grpc.StatusCode.UNAVAILABLE] >= 1, "in-flight requests must fail"
        # Retryable and never silent: nothing but UNAVAILABLE (a client deadline would mean a hang).
        assert set(load.failures) == {grpc.StatusCode.UNAVAILABLE}
    finally:
        server.stop()
    assert dev_shm() == before_shm
