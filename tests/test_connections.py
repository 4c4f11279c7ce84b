"""What a front-end process allows all its clients together, in each front end (the native one;
one Python process), each server a process of its own so that ``/proc`` reads it alone:

- the connection policy (``server/rules/connections.py``) as a bare HTTP/2 connection sees it: the
  streams per connection in the server's SETTINGS, its keepalive PINGs, a GOAWAY for a
  connection left idle and for one that pings too often; a stream cut once its connection's
  age and grace have passed, and the channel serving on;
- a ModelStreamInfer client that stops reading: the server stops taking its requests once the
  replies it holds pass --max-stream-backlog-bytes, its peak memory stays far below what those
  replies would take, other clients are served meanwhile, and once the client reads, every
  answer arrives, each once, right;
- model names clients make up never become metric labels: thousands of NOT_FOUND requests
  for made-up names count under one label, /metrics stays small and parses, and the
  repository's model keeps its series.
"""

from __future__ import annotations

import concurrent.futures
import threading

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchgate.protos import inference_pb2 as pb
from batchgate.server.metrics import UNKNOWN_MODEL_LABEL
from batchgate.server.rules.request_limits import wire_limits
from batchgate.server.config.settings import Settings
from batchgate.bench.harness.server import start_process
from batchgate.bench.harness.memory import PeakGrowth
from batchgate.bench.harness.metrics import parse_samples
from batchgate.bench.harness.repository import model_config, tensor, write_model
from tests.support.http2 import (
    ENHANCE_YOUR_CALM,
    GOAWAY,
    PING,
    SETTINGS,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    Http2Connection,
)
from tests.support.polling import poll
from tests.support.servers import start_multiprocess_server

MODES = ("native", "single")
MIB = 1 << 20
GROW_FACTOR = 16
GROW_CONFIG = model_config(
    "grow", max_batch_size=4, input=[tensor("X", "FP32", [-1])],
    output=[tensor("Y", "FP32", [-1]), tensor("Z", "FP32", [-1])],
    dynamic_batching={"max_queue_delay_microseconds": 0}, parameters={"warmup": "false"})
GROW_MODEL = f"""
import torch


class Grow(torch.nn.Module):
    def forward(self, x):
        return x.repeat(1, {GROW_FACTOR}), x.clone()


def build_model(parameters):
    return Grow()
"""
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
STREAMS = 3
IDLE_S, AGE_S, GRACE_S = 2, 4, 1
POLICY_ARGS = ("--max-concurrent-streams", str(STREAMS), "--grpc-keepalive-time-s", "0.5",
               "--grpc-min-ping-interval-s", "5", "--grpc-max-ping-strikes", "1",
               "--grpc-max-connection-idle-s", str(IDLE_S),
               "--grpc-max-connection-age-s", str(AGE_S),
               "--grpc-max-connection-age-grace-s", str(GRACE_S))
BACKLOG_BYTES = 8 * MIB
REPLY_VALUES = 16384  # a 64 KiB request, a reply of ~1.06 MiB
NAME_REFUSAL = wire_limits(Settings())["name_bytes"][1]
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def start(mode: str, root, extra_args: tuple[str, ...]):
    write_model(root, GROW_CONFIG, GROW_MODEL)
    if mode == "native":
        running = start_multiprocess_server(root, extra_args=extra_args)
        running.serving_pid = running.supervisor.pids("frontend")[0]
    else:
        running = start_process(root, "single", extra_args=(
            "--no-gc-freeze", "--drain-timeout-s", "10", *extra_args))
        running.serving_pid = running.pid
    return running


@pytest.fixture(scope="module", params=MODES)
def policy_server(request, tmp_path_factory):
    running = start(request.param, tmp_path_factory.mktemp(f"policy-{request.param}"),
                    POLICY_ARGS)
    yield running
    running.stop()


@pytest.fixture(scope="module", params=MODES)
def server(request, tmp_path_factory):
    running = start(request.param, tmp_path_factory.mktemp(f"edge-{request.param}"),
                    ("--max-stream-backlog-bytes", str(BACKLOG_BYTES)))
    yield running
    running.stop()


def grow_request(values: int = 4, id: str = "valid") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="grow", id=id)
    request.inputs.add(name="X", datatype="FP32", shape=[1, values])
    request.raw_input_contents.append(np.arange(values, dtype=np.float32).tobytes())
    return request


def check_grow_reply(reply: pb.ModelInferResponse, values: int = 4) -> None:
    y, z = (np.frombuffer(raw, np.float32) for raw in reply.raw_output_contents)
    np.testing.assert_array_equal(z, np.arange(values, dtype=np.float32))
    np.testing.assert_array_equal(y, np.tile(z, GROW_FACTOR))


def answered_correctly(address: str) -> None:
    with grpc.insecure_channel(address, options=UNLIMITED) as channel:
        data = channel.unary_unary(INFER)(grow_request().SerializeToString(), timeout=60)
        check_grow_reply(pb.ModelInferResponse.FromString(data))


# -- the connection policy -------------------------------------------------------------------


def test_a_connection_gets_the_stream_limit_and_keepalive_pings(policy_server):
    with Http2Connection(policy_server.address) as connection:
        settings = connection.wait_for(SETTINGS, flags=0).settings()
        assert settings[SETTINGS_MAX_CONCURRENT_STREAMS] == STREAMS
        connection.wait_for(PING, flags=0)  # the server's keepalive ping, acknowledged
    answered_correctly(policy_server.address)


def test_an_idle_connection_is_told_to_go(policy_server):
    with Http2Connection(policy_server.address) as connection:
        last, _, debug = connection.wait_for(GOAWAY, timeout_s=30 * IDLE_S).goaway()
        # gRPC's idle GOAWAY ("enter idle" in C++ 1.51, "connection idle" in grpcio); an
        # age's first one would name the last stream 2**31 - 1.
        assert last == 0 and b"idle" in debug, debug
    answered_correctly(policy_server.address)


def test_a_connection_that_pings_too_often_is_closed(policy_server):
    with Http2Connection(policy_server.address) as connection:
        connection.wait_for(SETTINGS, flags=0)
        for _ in range(4):
            connection.send_ping()
        _, code, debug = connection.wait_for(GOAWAY).goaway()
        assert (code, debug) == (ENHANCE_YOUR_CALM, b"too_many_pings")
    answered_correctly(policy_server.address)


def test_a_stream_past_its_connections_age_and_grace_is_cut_and_the_channel_serves_on(
        policy_server):
    with grpc.insecure_channel(policy_server.address) as channel:
        requests = _Requests()
        answers = channel.stream_stream(STREAM)(iter(requests), timeout=60 * AGE_S)
        requests.send(grow_request().SerializeToString())
        first = pb.ModelStreamInferResponse.FromString(next(answers))
        check_grow_reply(first.infer_response)
        # Nothing more is sent: the stream stays open until the age and its grace have passed.
        with pytest.raises(grpc.RpcError) as cut:
            next(answers)
        assert cut.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                    grpc.StatusCode.CANCELLED), cut.value
        requests.close()
        data = channel.unary_unary(INFER)(grow_request().SerializeToString(), timeout=60)
        check_grow_reply(pb.ModelInferResponse.FromString(data))


class _Requests:
    """A request iterator fed from the test: ``send`` a message, ``close`` to half-close."""

    def __init__(self) -> None:
        self._items: list = []
        self._ready = threading.Condition()

    def send(self, item) -> None:
        with self._ready:
            self._items.append(item)
            self._ready.notify()

    def close(self) -> None:
        self.send(None)

    def __iter__(self):
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._items)
                item = self._items.pop(0)
            if item is None:
                return
            yield item


# -- a client that does not read -------------------------------------------------------------


def test_a_stream_whose_client_stops_reading_stops_being_read(server):
    count = 300
    data = [grow_request(REPLY_VALUES, id=f"r{i}").SerializeToString() for i in range(count)]
    reply_bytes = REPLY_VALUES * 4 * (GROW_FACTOR + 1)
    answered_correctly(server.address)  # warm: what the first call allocates is not the test's
    pauses = server.metric("batchgate_stream_pauses_total")
    with grpc.insecure_channel(server.address, options=UNLIMITED) as slow:
        with PeakGrowth(server.serving_pid) as peak:
            answers = slow.stream_stream(STREAM)(iter(data), timeout=300)
            # The client reads nothing: the server fills its backlog, then stops reading.
            poll(lambda: server.metric("batchgate_stream_pauses_total") > pauses, 120,
                 "the stream paused")
            held = server.metric("batchgate_stream_backlog_bytes")
            # Others are served while it is paused.
            answered_correctly(server.address)
            with grpc.insecure_channel(server.address, options=UNLIMITED) as other:
                streamed = [pb.ModelStreamInferResponse.FromString(m) for m in
                            other.stream_stream(STREAM)(iter(data[:2]), timeout=120)]
            assert sorted(r.infer_response.id for r in streamed) == ["r0", "r1"]
            for r in streamed:
                check_grow_reply(r.infer_response, REPLY_VALUES)
        # The backlog held to its bound and the largest reply (the estimate of the one at the
        # model): far below the ~300 MiB those replies would take.
        assert held <= BACKLOG_BYTES + 2 * reply_bytes, held
        assert peak.bytes <= 96 * MIB, (
            f"the {server.mode} server rose {peak.bytes / MIB:.0f} MiB for a stream whose "
            f"replies take {count * reply_bytes / MIB:.0f} MiB")
        # Once the client reads, every answer comes, each once, and right.
        ids = []
        for message in answers:
            reply = pb.ModelStreamInferResponse.FromString(message)
            assert not reply.error_message, reply.error_message
            check_grow_reply(reply.infer_response, REPLY_VALUES)
            ids.append(reply.infer_response.id)
    assert sorted(ids) == sorted(f"r{i}" for i in range(count))
    poll(lambda: server.metric("batchgate_stream_backlog_bytes") == 0, 30,
         "the backlog gauge back to 0")


# -- metric labels ---------------------------------------------------------------------------


def _flood(address: str, names: list[bytes]) -> list[tuple[str, str]]:
    def call(name: bytes) -> tuple[str, str]:
        request = pb.ModelInferRequest(id="flood")
        request.model_name = name.decode()
        request.inputs.add(name="X", datatype="FP32", shape=[1, 1])
        request.raw_input_contents.append(bytes(4))
        try:
            unary(request.SerializeToString(), timeout=60)
        except grpc.RpcError as err:
            return err.code().name, err.details()
        return "OK", ""

    with grpc.insecure_channel(address, options=UNLIMITED) as channel:
        unary = channel.unary_unary(INFER)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return list(pool.map(call, names))


def test_made_up_model_names_never_become_labels(server):
    answered_correctly(server.address)
    before = parse_samples(server.metrics_text())
    unknown = ("batchgate_requests_total",
               (("model", UNKNOWN_MODEL_LABEL), ("status", "NOT_FOUND")))
    with PeakGrowth(server.serving_pid) as peak:
        # 60 kB names: refused by the wire scan before anything names a model.
        refused = _flood(server.address, [b"%05d" % i + b"m" * 60_000 for i in range(3000)])
        # Names under --max-request-name-bytes: each NOT_FOUND, all under one label.
        not_found = _flood(server.address, [b"%05d" % i + b"n" * 1000 for i in range(3000)])
    assert set(refused) == {("RESOURCE_EXHAUSTED", NAME_REFUSAL)}
    assert {code for code, _ in not_found} == {"NOT_FOUND"}
    assert not_found[0][1].startswith("unknown model '00000nnnn")
    assert peak.bytes <= 64 * MIB, f"the {server.mode} server rose {peak.bytes / MIB:.0f} MiB"
    answered_correctly(server.address)
    text = server.metrics_text()
    assert len(text.encode()) < 1_000_000
    families = {f.name: f for f in text_string_to_metric_families(text)}
    labels = {s.labels.get("model") for f in families.values() for s in f.samples}
    assert not any(label and label.startswith(("0", "m" * 10)) for label in labels), labels
    after = parse_samples(text)
    assert after[unknown] - before.get(unknown, 0) == 3000
    # The repository's model keeps its series, counting on.
    ok = ("batchgate_requests_total", (("model", "grow"), ("status", "OK")))
    assert after[ok] == before[ok] + 1
    assert after[("batchgate_request_seconds_count", (("model", "grow"),))] == after[ok]
