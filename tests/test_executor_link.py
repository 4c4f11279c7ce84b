"""The native front end's end of the executor wire, against an executor the test plays
(``tests/support/wire_peers.py``): the frame limit both ends read from wire.proto, and what the
front end does when its connection is lost and comes back.

Every front end here is the real binary, in native mode (BATCHGATE_REQUIRE_NATIVE makes a
missing build fail), with a real gRPC client in front of it.
"""

from __future__ import annotations

import os
import time

import grpc
import numpy as np
import pytest

from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc, wire_pb2
from batchgate.server.ipc import wire
from tests.support.sanitizers import SANITIZED, SANITIZER_ENV, SANITIZER_REPORTS
from tests.support.servers import native_or_skip
from tests.support.wire_peers import FakeExecutor, NativeFrontEnd, model_state

ARENA_BYTES = 64 << 20


@pytest.fixture
def arena():
    native_or_skip()
    shared = SharedArena.create(ARENA_BYTES)
    yield shared
    shared.close()


@pytest.fixture(params=["native", "native-asan"])
def start(request):
    """Starts the front end: the release build, then the sanitizer build (AddressSanitizer and
    UBSan, as test_native_parity runs it), whose log must hold no report once it has stopped."""
    started: list[NativeFrontEnd] = []
    options = {}
    if request.param == "native-asan":
        if not SANITIZED.is_file():
            reason = f"the sanitizer build {SANITIZED} is missing (make native-asan)"
            if os.environ.get("BATCHGATE_REQUIRE_NATIVE"):
                pytest.fail(reason)
            pytest.skip(reason)
        options = {"binary": SANITIZED, "env": {**os.environ, **SANITIZER_ENV}}

    def start_front_end(arena, executor, **settings) -> NativeFrontEnd:
        started.append(NativeFrontEnd(arena, executor.name, **options, **settings))
        return started[-1]

    yield start_front_end
    for front_end in started:
        front_end.stop()
        log = b"".join(front_end.raw)
        found = [marker for marker in SANITIZER_REPORTS if marker in log]
        assert not found, log[log.find(found[0]) - 200:][:4000].decode(errors="replace")


@pytest.fixture
def executor():
    fake = FakeExecutor()
    yield fake
    fake.close()


def output_block(arena: SharedArena, index: int = 0, nbytes: int = 1 << 20) -> int:
    """The arena offset of the ``index``-th block of ``nbytes`` in the executor's region."""
    start, size = ArenaLayout(arena.size, 1).output_region()
    assert (index + 1) * nbytes <= size
    return start + index * nbytes


def infer_request(values: np.ndarray, request_id: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id=request_id)
    request.inputs.add(name="x", datatype="FP32", shape=values.shape)
    request.raw_input_contents.append(values.astype(np.float32).tobytes())
    return request


def answer(end, arena: SharedArena, infer: wire_pb2.Infer, values: np.ndarray,
           block: int) -> None:
    """Answer ``infer`` with ``values`` written at ``block`` of the arena."""
    data = values.astype(np.float32)
    arena.write(block, data)
    end.write(wire_pb2.ToFrontend(results=[wire_pb2.Result(
        rid=infer.rid, released=True, outputs=[wire_pb2.Output(
            block=block, offset=block, nbytes=data.nbytes, shape=data.shape)])]))


def serves(end, arena: SharedArena, stub, value: float = 1.0) -> None:
    """A request through gRPC reaches ``end`` (the fake executor's connection), which answers
    it: the client gets what the executor wrote."""
    values = np.full((1, 4), value, np.float32)
    future = stub.ModelInfer.future(infer_request(values), timeout=30)
    frame = end.read_until(lambda f: len(f.infer) or len(f.groups), "the request")
    assert len(frame.infer) == 1
    answer(end, arena, frame.infer[0], values * 2, output_block(arena, 31))
    reply = future.result()
    assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [value * 2] * 4


def connect(executor: FakeExecutor, front_end: NativeFrontEnd, **model):
    """The front end's next connection, welcomed with model ``m`` (``model_state(**model)``)."""
    end = executor.accept()
    end.read_hello()
    end.welcome(model_state(**model))
    return end


def test_frames_up_to_the_wire_limit_are_read_and_a_larger_one_drops_only_the_link(
        arena, executor, start):
    """wire.proto's MAX_FRAME_BYTES is the one limit of both ends: the native front end takes
    a frame of exactly that many bytes (Python's wire.MAX_FRAME_BYTES), and treats one byte
    more as a protocol error that ends the connection; it then connects again and serves."""
    assert wire.MAX_FRAME_BYTES == wire_pb2.MAX_FRAME_BYTES == 64 << 20
    front_end = start(arena, executor)
    try:
        end = connect(executor, front_end)
        front_end.wait_for("frontend_ready")
        with grpc.insecure_channel(front_end.address) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            serves(end, arena, stub)
            # A model state whose reason fills the frame to the byte.
            full = wire_pb2.ToFrontend(models=[wire_pb2.ModelState(
                name="other", state="UNAVAILABLE", reason="")])
            reason = 0
            while full.ByteSize() != wire.MAX_FRAME_BYTES:  # length prefixes grow with it
                reason += wire.MAX_FRAME_BYTES - full.ByteSize()
                full.models[0].reason = "r" * reason
            assert full.ByteSize() == wire.MAX_FRAME_BYTES
            end.write(full)
            serves(end, arena, stub, 3.0)  # still the same connection
            end.write_raw(wire.HEADER.pack(wire.MAX_FRAME_BYTES + 1))
            assert end.closed_by_peer()
            error = front_end.wait_for("executor_protocol_error")[0]["error"]
            assert error == f"the executor sent a {wire.MAX_FRAME_BYTES + 1}-byte frame"
            end = connect(executor, front_end)
            front_end.wait_for("executor_connected", 2)
            serves(end, arena, stub, 5.0)
    finally:
        front_end.stop()


def read_infers(end, count: int) -> list[wire_pb2.Infer]:
    """The next ``count`` requests the front end sends, those of an InferGroup as the Infers
    they stand for (rid and input offset only)."""
    infers: list[wire_pb2.Infer] = list()
    while len(infers) < count:
        frame = end.read()
        infers += frame.infer
        for group in frame.groups:
            infers += [wire_pb2.Infer(rid=rid, inputs=[wire_pb2.Tensor(offset=offset)])
                       for rid, offset in zip(group.rids, group.inputs[0].offsets)]
    return infers


def test_inputs_of_requests_left_in_flight_are_kept_until_the_executor_lets_go(
        arena, executor, start):
    """The executor drops the connection while a request is in flight, and lives on (a batch
    still reading the request's input block): the front end keeps the block, the welcome of its
    next connection says it is still read (held), and the next request goes elsewhere; the block
    is reused only once released_inputs names it. Before, the loss freed it, and the next
    client's bytes went where the batch was reading."""
    front_end = start(arena, executor)
    try:
        end = connect(executor, front_end)
        front_end.wait_for("frontend_ready")
        with grpc.insecure_channel(front_end.address) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            lost = stub.ModelInfer.future(infer_request(np.full((1, 4), 1.0)), timeout=30)
            (left,) = read_infers(end, 1)
            held_at = left.inputs[0].offset
            end.close()
            with pytest.raises(grpc.RpcError) as failed:
                lost.result()
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert failed.value.details() == "the executor process restarted; retry the request"
            end = executor.accept()
            end.read_hello()
            end.welcome(model_state(), held=[wire_pb2.InputBlock(offset=held_at, nbytes=16)])
            front_end.wait_for("executor_connected", 2)
            pending = stub.ModelInfer.future(infer_request(np.full((1, 4), 2.0)), timeout=30)
            (second,) = read_infers(end, 1)
            assert second.inputs[0].offset != held_at
            assert np.frombuffer(bytes(arena.read(held_at, 16)), np.float32).tolist() == [1.0] * 4
            answer(end, arena, second, np.full((1, 4), 4.0), output_block(arena))
            assert np.frombuffer(pending.result().raw_output_contents[0], np.float32).tolist() \
                == [4.0] * 4
            end.write(wire_pb2.ToFrontend(released_inputs=[held_at]))
            # Once the front end has read that, its region is empty between requests, and the
            # next request takes the lowest block: the one that was held.
            deadline = time.monotonic() + 30
            while True:
                later = stub.ModelInfer.future(infer_request(np.full((1, 4), 3.0)), timeout=30)
                (infer,) = read_infers(end, 1)
                answer(end, arena, infer, np.full((1, 4), 6.0), output_block(arena))
                assert later.result().raw_output_contents
                if infer.inputs[0].offset == held_at:
                    break
                assert time.monotonic() < deadline, "the held block was never reused"
    finally:
        front_end.stop()


def test_no_answer_of_a_lost_connection_is_read_after_the_front_end_says_hello_again(
        arena, executor, start):
    """An executor answers with 8 MiB outputs and drops the connection at once; once the front
    end has said Hello again, the executor (as wire.proto allows) writes another client's bytes
    into the same block. Every reply is either the first client's bytes, whole, or UNAVAILABLE:
    the front end never copies a lost connection's answer after its Hello. Before, the worker
    still copying (or yet to copy) the answer read the other client's bytes."""
    values = 2 * 1024 * 1024  # floats: 8 MiB
    front_end = start(arena, executor, max_message_bytes=64 << 20)
    try:
        end = connect(executor, front_end, dims=(-1,))
        front_end.wait_for("frontend_ready")
        block = output_block(arena, 0, 16 << 20)
        with grpc.insecure_channel(front_end.address, options=[
                ("grpc.max_receive_message_length", 64 << 20)]) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            outcomes = []
            for trial in range(6):
                front_end.wait_for("executor_connected", trial + 1)  # the welcome is in
                futures = [stub.ModelInfer.future(infer_request(np.full((1, 4), 1.0)),
                                                  timeout=60) for _ in range(4)]
                infers = read_infers(end, len(futures))
                mine = np.full((1, values), 1.0 + trial, np.float32)
                arena.write(block, mine)
                end.write(wire_pb2.ToFrontend(results=[wire_pb2.Result(
                    rid=infer.rid, released=True, outputs=[wire_pb2.Output(
                        block=block, offset=block, nbytes=mine.nbytes, shape=mine.shape)])
                    for infer in infers]))
                end.close()
                end = executor.accept()
                end.read_hello()
                arena.write(block, np.full((1, values), -7.0, np.float32))  # another client's
                end.welcome(model_state(dims=(-1,)))
                for future in futures:
                    try:
                        data = np.frombuffer(future.result().raw_output_contents[0], np.float32)
                    except grpc.RpcError as err:
                        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                        assert err.details() == \
                            "the executor process restarted; retry the request"
                        outcomes.append("unavailable")
                        continue
                    assert data.size == values and bool((data == 1.0 + trial).all()), \
                        f"trial {trial}: {np.unique(data)[:4]} in the reply"
                    outcomes.append("whole")
            assert len(outcomes) == 24
            front_end.wait_for("executor_connected", 7)
            serves(end, arena, stub)
            print(f"replies of a lost connection: {outcomes.count('whole')} whole, "
                  f"{outcomes.count('unavailable')} UNAVAILABLE")
    finally:
        front_end.stop()


def test_an_executor_that_drops_each_connection_is_tried_ever_more_slowly(
        arena, executor, start):
    """An executor that accepts and drops at once: the front end waits 50, 100, 200, 400 and
    800 ms between tries (at least), and says so once, not once per try. A connection that
    lasts (a second or more) starts afresh: the next loss is tried again at once."""
    front_end = start(arena, executor)
    try:
        times = executor.accept_times(6)
        gaps = np.diff(times)
        assert all(gap >= expected / 1000 for gap, expected in zip(gaps, [50, 100, 200, 400,
                                                                          800])), gaps
        lost = front_end.events("executor_lost")
        assert len(lost) == 1 and lost[0]["losses"] == 1 and lost[0]["reconnect_in_ms"] == 50
        end = connect(executor, front_end)
        front_end.wait_for("frontend_ready")
        time.sleep(1.2)  # what a lasting connection is: past the second that is not
        end.close()
        lasted = front_end.wait_for("executor_lost", 2)[1]
        assert lasted["reconnect_in_ms"] == 0 and lasted["losses"] == 6
        connect(executor, front_end)
        front_end.wait_for("executor_connected", 2)
    finally:
        front_end.stop()
