"""Failure isolation of the multi-process mode, with real processes under load.

Each test runs its own supervisor (the shared ``server`` fixture must not be killed) on the
example ``mlp`` model, with closed-loop SDK clients on threads, bounded in count and time.
"""

from __future__ import annotations

import os
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
import pytest

from batchgate.clients import Client, RetryPolicy
from tests.support.load import Load
from tests.support.polling import poll
from tests.support.regions import servers_leftovers
from tests.support.servers import start_multiprocess_server

# Slow (each test runs its own supervisor under load and kills its children): make test-fast
# leaves it out.
pytestmark = pytest.mark.slow


def dev_shm() -> set[str]:
    """What is in /dev/shm, less what test clients make: a server's leftovers would show here."""
    names = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    return servers_leftovers(names)


@pytest.fixture
def mlp_only(tmp_path):
    import shutil

    from tests.support import EXAMPLE_MODELS

    shutil.copytree(EXAMPLE_MODELS / "mlp", tmp_path / "mlp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def pids(server, role: str) -> dict:
    return server.supervisor.pids(role)


def test_killed_native_front_end_is_restarted_and_its_counts_carry_over(mlp_only):
    before_shm = dev_shm()
    server = start_multiprocess_server(mlp_only)
    try:
        [old] = pids(server, "frontend").values()
        # One front end: while it restarts the port refuses connections; retries bridge that.
        retry = RetryPolicy(max_attempts=30, initial_backoff_s=0.05, max_backoff_s=0.5)
        with Load(server.address, retry=retry) as load:
            poll(lambda: load.answered() > 50, what="load running")
            counted = server.metric("batchgate_requests_total", model="mlp", status="OK")
            os.kill(old, signal.SIGKILL)
            answered_at_kill = load.answered()
            poll(lambda: pids(server, "frontend").get(0) not in (None, old), 60,
                 "the native front end restarted")
            served = load.answered()
            poll(lambda: load.answered() > served + 50, 60, "serving after the restart")
        print(f"native front-end kill: ok={load.ok} failures={dict(load.failures)}")
        poll(lambda: server.metric("batchgate_arena_bytes_in_use") == 0, 30, "arena empty")
        assert load.wrong == 0 and not load.failures
        # What the dead process counted up to the last scrape before it died is kept, beside
        # what the new one answered: every answer after the kill, less those the old one had
        # sent and counted after the scrape that were still on their way (one per client).
        total = server.metric("batchgate_requests_total", model="mlp", status="OK")
        assert total >= counted + (load.ok - answered_at_kill) - 8
        assert server.metric("batchgate_child_restarts_total", role="frontend") == 1
    finally:
        server.stop()
    assert dev_shm() == before_shm


def test_killed_executor_answers_unavailable_then_serves_again(mlp_only):
    before_shm = dev_shm()
    server = start_multiprocess_server(mlp_only)
    try:
        old = pids(server, "executor")[None]
        with Load(server.address) as load, grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = lambda: health.Check(health_pb2.HealthCheckRequest(service="")).status
            poll(lambda: load.answered() > 50, what="load running")
            os.kill(old, signal.SIGKILL)
            # While no executor runs, the front end says so.
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


def test_no_client_gets_another_clients_answer_across_an_executor_restart(mlp_only):
    """Two loads whose inputs differ (so an answer says whose it is) while the executor is
    killed and restarted under them: every answer that comes back is its own request's, before,
    during and after; the new executor welcomed the front end only once it had said Hello
    again (wire.proto: it may still have been copying out of the output region it reuses)."""
    server = start_multiprocess_server(mlp_only)
    try:
        old = pids(server, "executor")[None]
        with Load(server.address, clients=4, seed=1) as one, \
                Load(server.address, clients=4, seed=2) as two:
            poll(lambda: one.answered() > 50 and two.answered() > 50, what="both loads running")
            os.kill(old, signal.SIGKILL)
            poll(lambda: pids(server, "executor").get(None) not in (None, old), 120,
                 "executor restarted")
            served = one.answered(), two.answered()
            poll(lambda: one.answered() > served[0] + 50 and two.answered() > served[1] + 50,
                 120, "both loads served after the restart")
        print(f"executor kill, two loads: ok={one.ok}+{two.ok} "
              f"failures={dict(one.failures + two.failures)}")
        assert one.wrong == 0 and two.wrong == 0
        assert set(one.failures) | set(two.failures) <= {grpc.StatusCode.UNAVAILABLE}
        awaited = [e for e in server.supervisor.events if e.get("event") == "awaiting_frontends"]
        assert awaited and awaited[-1]["slots"] == [0]
    finally:
        server.stop()
