"""The Python end of the executor wire (server/ipc/wire.py) over a real abstract Unix socket: frames
cut anywhere by reads, several in one read, a large one in many reads, and a peer that breaks
the framing, which ends the connection and nothing else."""

from __future__ import annotations

import asyncio
import os
import socket

import numpy as np
import pytest

from batchgate.protos import wire_pb2
from batchgate.server.ipc import wire


def _name() -> str:
    return f"batchgate-test-wire-{os.getpid()}-{os.urandom(4).hex()}"


def _frame(message: wire_pb2.ToExecutor) -> bytes:
    body = message.SerializeToString()
    return wire.HEADER.pack(len(body)) + body


class _Executor:
    """serve_frontends with a handler that records each frame and answers the first one."""

    def __init__(self) -> None:
        self.frames: list[wire_pb2.ToExecutor] = []
        self.ended = asyncio.Event()
        self.error: BaseException | None = None
        self.got = asyncio.Event()
        self.read_marks: list[int] = []  # frames handed over when each read() came

    def accept(self, link: wire.FrontendLink) -> _Executor.Connection:
        return self.Connection(self, link)

    class Connection:
        def __init__(self, executor: _Executor, link: wire.FrontendLink) -> None:
            self.executor, self.link = executor, link

        def frame(self, frame: wire_pb2.ToExecutor) -> None:
            executor = self.executor
            executor.frames.append(frame)
            executor.got.set()
            if len(executor.frames) == 1:
                self.link.out.welcome = True

        def read(self) -> None:
            self.executor.read_marks.append(len(self.executor.frames))

        def lost(self, reason: ConnectionError) -> None:
            self.executor.error = reason  # recorded for the test to look at
            self.link.close()
            self.executor.ended.set()

    async def wait_frames(self, count: int, timeout_s: float = 10.0) -> None:
        async def enough() -> None:
            while len(self.frames) < count:
                self.got.clear()
                await self.got.wait()

        await asyncio.wait_for(enough(), timeout_s)


async def _connect(name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(wire.socket_address(name))


@pytest.mark.asyncio
async def test_frames_cut_anywhere_and_packed_together_arrive_whole_in_order() -> None:
    name, executor = _name(), _Executor()
    server = await wire.serve_frontends(name, executor.accept)
    try:
        reader, writer = await _connect(name)
        frames = [wire_pb2.ToExecutor(cancel=[i, i + 1]) for i in range(1, 40, 2)]
        data = b"".join(_frame(f) for f in frames)
        # The first frame byte by byte, then the rest in uneven pieces, one of them spanning
        # several frames.
        first = len(_frame(frames[0]))
        for i in range(first):
            writer.write(data[i:i + 1])
            await writer.drain()
        for start, stop in ((first, first + 3), (first + 3, first + 50), (first + 50, len(data))):
            writer.write(data[start:stop])
            await writer.drain()
        await executor.wait_frames(len(frames))
        assert [list(f.cancel) for f in executor.frames] == [list(f.cancel) for f in frames]
        # read() follows each read that completed frames, once, after them: never a read that
        # completed none (the first frame's bytes one by one), never before its frames.
        marks = executor.read_marks
        assert marks == sorted(set(marks)) and marks[0] >= 1 and marks[-1] == len(frames)
        # The executor's answer (written once the handler returned) reaches the peer framed.
        (length,) = wire.HEADER.unpack(await reader.readexactly(wire.HEADER.size))
        reply = wire_pb2.ToFrontend.FromString(await reader.readexactly(length))
        assert reply.welcome
        writer.close()
        await asyncio.wait_for(executor.ended.wait(), 10)
        # The end of the stream reads as ConnectionError, as a broken frame does.
        assert isinstance(executor.error, ConnectionError)
        assert "closed" in str(executor.error)
    finally:
        server.close()


@pytest.mark.asyncio
async def test_a_large_frame_in_many_reads() -> None:
    name, executor = _name(), _Executor()
    server = await wire.serve_frontends(name, executor.accept)
    try:
        _, writer = await _connect(name)
        big = wire_pb2.ToExecutor(free=list(range(1_000_000)))  # ~3 MB: many socket reads
        small = wire_pb2.ToExecutor(cancel=[7])
        writer.write(_frame(big) + _frame(small))
        await writer.drain()
        await executor.wait_frames(2)
        assert list(executor.frames[0].free) == list(range(1_000_000))
        assert list(executor.frames[1].cancel) == [7]
        writer.close()
    finally:
        server.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("garbage", [
    wire.HEADER.pack(wire.MAX_FRAME_BYTES + 1),  # a length no frame may have
    wire.HEADER.pack(3) + b"\xff\xff\xff",  # not a ToExecutor
], ids=["oversized", "malformed"])
async def test_a_broken_frame_ends_that_connection_only(garbage: bytes) -> None:
    name, executor = _name(), _Executor()
    server = await wire.serve_frontends(name, executor.accept)
    try:
        reader, writer = await _connect(name)
        writer.write(_frame(wire_pb2.ToExecutor(cancel=[1])) + garbage)
        await writer.drain()
        await asyncio.wait_for(executor.ended.wait(), 10)
        assert isinstance(executor.error, ConnectionError)
        assert "closed" not in str(executor.error)  # the frame's fault, not the stream's end
        assert len(executor.frames) == 1  # what came before the broken frame was handled
        # The executor closed its end.
        assert await asyncio.wait_for(_read_to_end(reader), 10)
        # And it still takes new front ends.
        other = _Executor()
        server.close()
        server = await wire.serve_frontends(name, other.accept)
        _, writer2 = await _connect(name)
        writer2.write(_frame(wire_pb2.ToExecutor(cancel=[9])))
        await writer2.drain()
        await other.wait_frames(1)
        writer2.close()
    finally:
        server.close()


async def _read_to_end(reader: asyncio.StreamReader) -> bool:
    while await reader.read(65536):
        pass
    return True


@pytest.mark.asyncio
async def test_a_front_end_link_reads_what_the_executor_writes() -> None:
    name = _name()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(wire.socket_address(name))
    listener.listen(1)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        link_task = asyncio.ensure_future(wire.connect_to_executor(name))
        peer, _ = await loop.sock_accept(listener)
        link = await link_task
        first = wire_pb2.ToFrontend(welcome=True).SerializeToString()
        second = wire_pb2.ToFrontend(released=[4, 5]).SerializeToString()
        data = wire.HEADER.pack(len(first)) + first + wire.HEADER.pack(len(second)) + second
        await loop.sock_sendall(peer, data[:3])
        await loop.sock_sendall(peer, data[3:])
        got = [await asyncio.wait_for(link.receive(), 10) for _ in range(2)]
        assert got[0].welcome and list(got[1].released) == [4, 5]
        peer.close()
        with pytest.raises(ConnectionError):  # the end of the stream
            await asyncio.wait_for(link.receive(), 10)
        link.close()
        assert link.closed
    finally:
        listener.close()


# -- a batch's answers: one Batch, or a Result each ---------------------------------------------


class _FrameSink:
    """A front end's link as the executor sees it: ``out`` is the frame being filled."""

    def __init__(self) -> None:
        self.out = wire_pb2.ToFrontend()

    def room(self, nbytes: int) -> wire_pb2.ToFrontend:
        """The frame being filled (wire.Link.room: here one frame takes everything)."""
        return self.out


def _answer_batch(rows: list[int], released: bool, wants: dict[int, tuple[int, ...]]):
    """What a front end reads of one batch of requests of ``rows`` each (``wants``: rid -> the
    outputs it names; every output otherwise): per rid, its outputs' bytes and shapes, read from
    the arena as a front end copies them; the frame's Batch count; the references it holds."""
    from batchgate.server.ipc.arena import ArenaLayout, SharedArena
    from batchgate.batcher.request import DONE, TAKEN, InferenceRequest
    from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
    from batchgate.server.executor.fronts import Caller, FrontEnd
    from batchgate.server.executor.server import ExecutorServer

    arena = SharedArena.create(1 << 20)
    try:
        server = ExecutorServer(arena, ArenaLayout(1 << 20, 1))
        front = FrontEnd(_FrameSink())
        spec = ModelSpec(name="m", version="1", platform="test",
                         inputs=(TensorSpec("x", "FP32", (2,)),),
                         outputs=(TensorSpec("y", "FP32", (2,)),
                                  TensorSpec("z", "INT64", (3, 1))),
                         batching=BatchingConfig(max_batch_size=8), warmup=False)
        model = type("Model", (), {"spec": spec})()
        outputs = _batch_outputs(sum(rows))
        requests, first_rows = [], []
        for rid, n in enumerate(rows, start=1):
            request = InferenceRequest([np.zeros((n, 2), np.float32)], batch_size=n)
            request.state = DONE if released else TAKEN
            asked = wants.get(rid, (0, 1))
            request.caller, request.tag = Caller(front, model, asked, None, asked == (0, 1)), rid
            front.requests[rid] = request
            first_rows.append(sum(rows[:rid - 1]))
            requests.append(request)
        server.answers.results(requests, first_rows, outputs)
        frame = front.link.out
        results = [*frame.results, *(r for b in frame.batches for r in wire.batch_results(b))]
        seen = {r.rid: (r.released, [(bytes(arena.read(o.offset, o.nbytes)), tuple(o.shape))
                                     for o in r.outputs]) for r in results}
        return seen, len(frame.batches), dict(front.blocks)
    finally:
        arena.close()


def _batch_outputs(total: int) -> list[np.ndarray]:
    return [np.arange(total * 2, dtype=np.float32).reshape(total, 2),
            np.arange(total * 3, dtype=np.int64).reshape(total, 3, 1)]


def _expected(rows: list[int], released: bool, wants: dict[int, tuple[int, ...]]) -> dict:
    outputs = _batch_outputs(sum(rows))
    expected, first = {}, 0
    for rid, n in enumerate(rows, start=1):
        expected[rid] = (released, [(outputs[k][first:first + n].tobytes(),
                                     outputs[k][first:first + n].shape)
                                    for k in wants.get(rid, (0, 1))])
        first += n
    return expected


@pytest.mark.parametrize("released", [True, False])
def test_a_batch_whose_requests_take_every_output_is_one_batch_message(released: bool) -> None:
    rows = [1, 3, 2, 1]
    seen, batches, blocks = _answer_batch(rows, released, {})
    assert seen == _expected(rows, released, {})
    assert batches == 1
    assert sorted(blocks.values()) == [len(rows), len(rows)]  # a reference per request


def test_a_batch_with_a_request_naming_its_outputs_is_a_result_each() -> None:
    rows, wants = [2, 1, 1], {2: (1,)}
    seen, batches, blocks = _answer_batch(rows, True, wants)
    assert seen == _expected(rows, True, wants)
    assert batches == 0
    assert sorted(blocks.values()) == [2, 3]  # y: requests 1 and 3; z: all three


# -- frames the executor writes stay under the limit ---------------------------------------------


@pytest.mark.asyncio
async def test_the_executor_splits_answers_across_frames_and_fails_alone_one_no_frame_holds(
        monkeypatch) -> None:
    """Answers that together pass MAX_FRAME_BYTES go in several frames (Results, and a Batch
    cut into several), every one under the limit; a request whose answer alone would pass it
    (its output descriptors: here the same output asked for 5,000 times) fails alone,
    RESOURCE_EXHAUSTED, and its neighbours are answered. The limit is read where it is used:
    lowered to 64 KiB here, the front end's reader refuses any frame past it, as the native
    front end does at the real limit."""
    from batchgate.server.ipc.arena import ArenaLayout, SharedArena
    from batchgate.batcher.request import DONE, InferenceRequest
    from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
    from batchgate.server.executor.fronts import Caller, FrontEnd
    from batchgate.server.executor.server import ExecutorServer

    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 64 * 1024)
    name = _name()
    arena = SharedArena.create(8 << 20)
    server = ExecutorServer(arena, ArenaLayout(8 << 20, 1))
    fronts: list[FrontEnd] = []

    class Handler:
        frame = read = staticmethod(lambda *_: None)

        @staticmethod
        def lost(_reason) -> None:
            pass

    def accept(link: wire.FrontendLink) -> Handler:
        fronts.append(FrontEnd(link))
        server.fronts.connected.add(fronts[-1])
        return Handler()

    listener = await wire.serve_frontends(name, accept)
    link = await wire.connect_to_executor(name)
    try:
        while not fronts:
            await asyncio.sleep(0.001)
        front = fronts[0]
        spec = ModelSpec(name="m", version="1", platform="test",
                         inputs=(TensorSpec("x", "FP32", (2,)),),
                         outputs=(TensorSpec("y", "FP32", (2,)),),
                         batching=BatchingConfig(max_batch_size=8192), warmup=False)
        model = type("Model", (), {"spec": spec})()

        def batch(wants: list[tuple[int, ...]], first_rid: int) -> dict[int, bytes]:
            requests, expected = [], {}
            outputs = [np.arange(len(wants) * 2, dtype=np.float32).reshape(len(wants), 2)]
            for i, outputs_asked in enumerate(wants):
                rid = first_rid + i
                request = InferenceRequest([np.zeros((1, 2), np.float32)], batch_size=1)
                request.state = DONE
                request.caller = Caller(front, model, outputs_asked, None, outputs_asked == (0,))
                request.tag = rid
                front.requests[rid] = request
                requests.append(request)
                expected[rid] = outputs[0][i].tobytes()
            server.answers.results(requests, range(len(wants)), outputs)
            return expected

        # Six Results of 300 outputs each (~6 KB each) and one of 5,000 (~100 KB): ~136 KB.
        each = batch([(0,) * 300] * 3 + [(0,) * 5000] + [(0,) * 300] * 3, 1)
        # 5,000 requests taking every output: one Batch of ~50 KB per frame would not do.
        together = batch([(0,)] * 5000, 100)
        results, failures, sizes = {}, {}, []
        while len(results) + len(failures) < len(each) + len(together):
            frame = await asyncio.wait_for(link.receive(), 10)
            sizes.append(frame.ByteSize())
            for result in [*frame.results, *(r for b in frame.batches
                                             for r in wire.batch_results(b))]:
                assert result.rid not in results
                results[result.rid] = [bytes(arena.read(o.offset, o.nbytes))
                                       for o in result.outputs]
            failures.update({f.rid: (f.code, f.message) for f in frame.failures})
        assert max(sizes) <= wire.MAX_FRAME_BYTES and len(sizes) >= 4
        assert failures == {4: (8, "the answer describes 5000 outputs, more than one frame from "
                                   "the executor process to the front end holds (65536 bytes); "
                                   "ask for fewer outputs")}
        assert {rid: outs for rid, outs in results.items() if rid < 100} == {
            rid: [data] * 300 for rid, data in each.items() if rid != 4}
        assert {rid: outs for rid, outs in results.items() if rid >= 100} == {
            rid: [data] for rid, data in together.items()}
        # A reference per output described, none for the failed request's.
        assert sum(front.blocks.values()) == 6 * 300 + 5000
    finally:
        link.close()
        listener.close()
        arena.close()
