"""The native front end's end of the executor wire, against an executor the test plays
(``tests/support/wire_peers.py``): the frame limit both ends read from wire.proto, and what the
front end does when its connection is lost and comes back.

Every front end here is the real binary, in native mode (BATCHGATE_REQUIRE_NATIVE makes a
missing build fail), with a real gRPC client in front of it.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from batchgate.batcher.arena import ArenaLayout, SharedArena
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc, wire_pb2
from batchgate.server import wire
from tests.support.servers import native_or_skip
from tests.support.wire_peers import FakeExecutor, NativeFrontEnd, model_state

ARENA_BYTES = 64 << 20


@pytest.fixture
def arena():
    native_or_skip()
    shared = SharedArena.create(ARENA_BYTES)
    yield shared
    shared.close()


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


def connect(executor: FakeExecutor, front_end: NativeFrontEnd):
    """The front end's next connection, welcomed with model ``m``."""
    end = executor.accept()
    end.read_hello()
    end.welcome(model_state())
    return end


def test_frames_up_to_the_wire_limit_are_read_and_a_larger_one_drops_only_the_link(
        arena, executor):
    """wire.proto's MAX_FRAME_BYTES is the one limit of both ends: the native front end takes
    a frame of exactly that many bytes (Python's wire.MAX_FRAME_BYTES), and treats one byte
    more as a protocol error that ends the connection; it then connects again and serves."""
    assert wire.MAX_FRAME_BYTES == wire_pb2.MAX_FRAME_BYTES == 64 << 20
    front_end = NativeFrontEnd(arena, executor.name)
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
