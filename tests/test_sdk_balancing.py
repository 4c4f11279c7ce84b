"""Client-side balancing in the SDK: health-aware round robin and resolved names.

Real grpc.aio servers on loopback (tests.support.fake_server, which counts the attempts each server
gets); a server here can be stopped and started again on the same port.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from batchgate.clients import AsyncClient, BatchgateError, Client, InferRequest, RetryPolicy
from batchgate.clients._endpoints import EndpointPool, resolve_dns
from batchgate.protos import inference_pb2
from tests.support.fake_server import FakeServer
from tests.support.polling import apoll, poll

RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.05, jitter=0)
# Reconnect quickly once a stopped server is back (gRPC's default first backoff is 1 s).
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)]
X = {"x": np.ones(1, dtype=np.float32)}


@pytest.fixture
def pair():
    servers = [FakeServer("a", health=False), FakeServer("b", health=False)]
    yield servers
    for server in servers:
        server.stop()


def served_by(client: Client) -> str:
    return client.infer_result("echo", X).parameters["served_by"]


def test_an_unavailable_server_is_skipped_during_its_cool_down(pair):
    a, b = pair
    b.servicer.unavailable_left["echo"] = 10**6  # b answers every call with UNAVAILABLE
    with Client([a.address, b.address], timeout_s=10, retry=RETRY, unhealthy_for_s=5) as c:
        for _ in range(20):
            assert served_by(c) == "a"  # no error surfaces: the retry goes to a
        assert c._pool.unhealthy() == [b.address]
    assert b.attempts == 1  # tried once, then skipped for its cool-down
    assert a.attempts == 20


def test_after_the_cool_down_a_server_is_tried_again_and_a_success_clears_it(pair):
    a, b = pair
    b.servicer.unavailable_left["echo"] = 1
    with Client([a.address, b.address], timeout_s=10, retry=RETRY, unhealthy_for_s=0.2) as c:
        assert {served_by(c) for _ in range(2)} == {"a"}
        assert b.attempts == 1
        started = time.monotonic()
        poll(lambda: b.attempts == 2, step=lambda: served_by(c))
        assert time.monotonic() - started >= 0.15
        # b succeeded: it is healthy again and takes its turn.
        assert sorted(served_by(c) for _ in range(4)) == ["a", "a", "b", "b"]
        assert c._pool.unhealthy() == []


def test_repeated_failures_double_the_cool_down_up_to_30_s():
    now = [0.0]
    pool = EndpointPool(lambda address: address, unhealthy_for_s=2, clock=lambda: now[0])
    pool.update(["a", "b"])
    cool_downs = []
    for _ in range(6):
        assert pool.pick(after="b") == "a"  # the retry after b goes to a: healthy again
        pool.release("a", grpc.StatusCode.UNAVAILABLE)
        assert pool.unhealthy() == ["a"]
        assert [pool.pick(), pool.pick(after="b")] == ["b", "b"]  # a skipped while cooling
        pool.release("b", None)
        pool.release("b", None)
        cool_downs.append(pool._slots["a"].unhealthy_until - now[0])
        now[0] = pool._slots["a"].unhealthy_until  # the cool-down is over
    assert cool_downs == [2, 4, 8, 16, 30, 30]
    pool.release(pool.pick(after="b"), None)  # a success clears a
    assert pool._slots["a"].failures == 0
    # With every address cooling down, the one whose cool-down ends first is used.
    pool.release(pool.pick(after="b"), grpc.StatusCode.UNAVAILABLE)
    now[0] += 1
    pool.release(pool.pick(after="a"), grpc.StatusCode.UNAVAILABLE)
    assert pool.unhealthy() == ["a", "b"]
    assert pool.pick() == "a" and pool.pick(after="a") == "a"
    pool.release("a", None)
    pool.release("a", None)
    now[0] += 2  # b's cool-down is over too
    assert pool.unhealthy() == [] and sorted([pool.pick(), pool.pick()]) == ["a", "b"]
    # Other errors do not make an address unhealthy.
    pool.release("a", grpc.StatusCode.INVALID_ARGUMENT)
    assert pool.unhealthy() == []


def test_a_stopped_server_is_skipped_then_gets_traffic_again_once_restarted(pair):
    a, b = pair
    port = b.port
    with Client(
        [a.address, b.address],
        timeout_s=10,
        retry=RETRY,
        unhealthy_for_s=0.2,
        options=FAST_RECONNECT,
    ) as c:
        assert sorted(served_by(c) for _ in range(2)) == ["a", "b"]
        b.stop()
        for _ in range(20):
            assert served_by(c) == "a"  # no error surfaces while b is down
        assert a.attempts == 21
        restarted = FakeServer("b2", port=port, health=False)
        pair.append(restarted)
        poll(lambda: restarted.attempts > 0, step=lambda: c.infer("echo", X))
        poll(lambda: c._pool.unhealthy() == [], step=lambda: c.infer("echo", X))
        before = restarted.attempts
        labels = [served_by(c) for _ in range(4)]
    assert labels.count("b2") == 2 and restarted.attempts == before + 2


def test_a_resolved_name_follows_the_resolver(pair):
    a, b = pair
    answer = [a.address, b.address]
    asked = []

    def resolver(target: str) -> list[str]:
        asked.append(target)
        return list(answer)

    with Client(
        "dns:///inference.example:8001",
        timeout_s=10,
        retry=RETRY,
        resolver=resolver,
        resolve_interval_s=0.05,
    ) as c:
        assert c.addresses == []  # resolved on the first call
        assert sorted(served_by(c) for _ in range(4)) == ["a", "a", "b", "b"]
        assert asked[0] == "inference.example:8001"
        assert c.addresses == [a.address, b.address]
        kept = c._pool._slots[a.address].endpoint
        removed = c._pool._slots[b.address].endpoint

        answer[:] = [a.address]
        poll(lambda: c.addresses == [a.address], step=lambda: c.infer("echo", X))
        b_before = b.attempts
        for _ in range(6):
            assert served_by(c) == "a"
        assert b.attempts == b_before
        assert c._pool._slots[a.address].endpoint is kept  # the remaining channel is kept
        with pytest.raises(ValueError, match="closed"):  # the removed one is closed
            removed.inference.ServerLive(inference_pb2.ServerLiveRequest())


def test_a_name_that_does_not_resolve_fails_as_unavailable_and_old_addresses_stay(pair):
    a, _ = pair
    answer: list = [OSError("no such host")]
    asked = []

    def resolver(target: str) -> list[str]:
        asked.append(target)
        if isinstance(answer[0], Exception):
            raise answer[0]
        return list(answer)

    with Client(
        "down.example:1", resolve=True, resolver=resolver, resolve_interval_s=0.05, retry=RETRY
    ) as c:
        with pytest.raises(BatchgateError) as caught:
            c.server_live()
        assert caught.value.code is grpc.StatusCode.UNAVAILABLE
        assert "cannot resolve 'down.example:1': no such host" in caught.value.details
        answer[:] = [a.address]
        assert c.server_live()
        answer[:] = [OSError("DNS is down")]  # a failed re-resolution keeps what was there
        asked_before = len(asked)
        poll(lambda: len(asked) > asked_before, step=c.server_live)
        assert c.server_live() and c.addresses == [a.address]


def test_every_address_failing_triggers_a_re_resolution(pair):
    a, b = pair
    b.stop()
    answers = [[b.address]]  # the first resolution finds b, every later one a (the pod moved)
    resolved = []

    def resolver(target: str) -> list[str]:
        resolved.append(answers.pop() if answers else [a.address])
        return resolved[-1]

    with Client(
        "svc.example:1",
        resolve=True,
        resolver=resolver,
        resolve_interval_s=3600,
        timeout_s=10,
        # Attempts at about 0, 0.4, 0.8 and 1.2 s: re-resolving for lack of a healthy address
        # happens at most once a second, so the fourth attempt finds a.
        retry=RetryPolicy(max_attempts=4, initial_backoff_s=0.4, max_backoff_s=0.4, jitter=0),
    ) as c:
        assert served_by(c) == "a"
        assert resolved == [[b.address], [a.address]]
        assert c.addresses == [a.address]


def test_localhost_resolves_with_getaddrinfo(pair):
    a, _ = pair
    addresses = resolve_dns(f"localhost:{a.port}")
    assert f"127.0.0.1:{a.port}" in addresses
    assert all(x.endswith(f":{a.port}") for x in addresses)
    with Client(f"localhost:{a.port}", resolve=True, timeout_s=10, retry=RETRY) as c:
        assert served_by(c) == "a"  # an unreachable ::1 (if listed) is skipped by the retry
        assert f"127.0.0.1:{a.port}" in c.addresses


async def test_async_client_balances_and_follows_the_resolver(pair):
    a, b = pair
    answer = [a.address, b.address]
    b.servicer.unavailable_left["echo"] = 10**6
    async with AsyncClient(
        "dns:///svc.example:1",
        resolver=lambda target: list(answer),
        resolve_interval_s=0.05,
        unhealthy_for_s=5,
        timeout_s=10,
        retry=RETRY,
    ) as c:
        for _ in range(10):
            result = await c.infer_result("echo", X)
            assert result.parameters["served_by"] == "a"
        assert b.attempts == 1
        answer[:] = [b.address]
        b.servicer.unavailable_left["echo"] = 0
        await apoll(lambda: c.addresses == [b.address], 10, "the pool moved to b",
                    step=lambda: c.infer("echo", X))
        result = await c.infer_result("echo", X)
        assert result.parameters["served_by"] == "b"
        # A stream picks its address when first read.
        async with c.stream_infer([InferRequest("echo", X)]) as stream:
            assert [r.parameters["served_by"] async for r in stream] == ["b"]


def test_new_settings_are_validated():
    for kwargs, error, message in [
        ({"unhealthy_for_s": -1}, ValueError, "got -1"),
        ({"unhealthy_for_s": 31}, ValueError, "got 31"),
        ({"unhealthy_for_s": "2"}, TypeError, "got '2'"),
        ({"resolve_interval_s": 0}, ValueError, "got 0"),
        ({"resolve_interval_s": float("inf")}, ValueError, "got inf"),
        ({"resolve": "yes"}, TypeError, "got 'yes'"),
        ({"resolver": 3}, TypeError, "got 3"),
    ]:
        for cls in (Client, AsyncClient):
            with pytest.raises(error, match=message):
                cls("localhost:1", **kwargs)
    with pytest.raises(ValueError, match="got 'no-port'"):
        Client("no-port", resolve=True)
    with pytest.raises(ValueError, match="got 'dns://8.8.8.8/svc:1'"):
        Client("dns://8.8.8.8/svc:1")
    with pytest.raises(ValueError, match="got 'svc'"):
        AsyncClient("dns:///svc")
    with Client("localhost:1") as c:  # nothing to resolve: the channel opens at once
        assert c.addresses == ["localhost:1"]
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.server_live()
