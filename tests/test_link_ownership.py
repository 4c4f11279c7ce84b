"""What the real executor process does with arena blocks when a front end's connection is lost
(wire.proto: "A lost connection does not end that ownership"), the front ends played by the
test (``tests/support/wire_peers.py``) so that each step comes when the test says.

- A lost connection's output blocks are not reused while its front-end process may still be
  copying them into replies: not by another front end's answers, until the same process says
  Hello again or exits. Before, the next answer went into the same block, so a reply being
  copied could carry another client's bytes.
- Input blocks a running batch still reads are listed in the next welcome (``held``) and
  announced when the batch lets go (``released_inputs``), instead of the front end freeing them
  on the loss and writing the next request over them.
- An executor started while front ends of its predecessor live welcomes none of them before
  each has said Hello or exited.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from batchgate.server.ipc.arena import ArenaLayout, SharedArena
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import wire_pb2
from batchgate.server.ipc import wire
from batchgate.bench.harness.repository import with_parameters, write_model
from tests.support.models import GATED_CONFIG, GATED_MODEL, Gate
from tests.support.wire_peers import ExecutorProcess, FakeFrontEnd

ROOT = str(Path(__file__).resolve().parent.parent)
ARENA_BYTES = 16 << 20
SLOTS = 2


@pytest.fixture
def gate(tmp_path):
    folder = tmp_path / "gate"
    folder.mkdir()
    return Gate(folder)


@pytest.fixture
def executor(tmp_path, gate):
    repository = tmp_path / "models"
    write_model(repository, with_parameters(GATED_CONFIG, gate_dir=gate.dir), GATED_MODEL)
    arena = SharedArena.create(ARENA_BYTES)
    process = ExecutorProcess(arena, repository, slots=SLOTS)
    process.arena = arena
    yield process
    gate.open()
    process.stop()
    arena.close()


def welcomed(front: FakeFrontEnd) -> tuple[wire_pb2.ToFrontend, int]:
    """The welcome, and the gated model's handle in it."""
    welcome = front.read_until(lambda f: f.welcome)
    (gated,) = [m for m in welcome.models if m.name == "gated"]
    return welcome, gated.handle


def send(front: FakeFrontEnd, arena: SharedArena, handle: int, rid: int, value: float,
         offset: int | None = None) -> int:
    """Infer ``rid``: one row of ``value`` written at ``offset`` (default: the start of the
    front end's input region) of the arena; the offset."""
    if offset is None:
        offset = ArenaLayout(arena.size, SLOTS).input_region(front.slot)[0]
    arena.write(offset, np.full((1, 2), value, np.float32))
    front.write(wire_pb2.ToExecutor(infer=[wire_pb2.Infer(
        rid=rid, model=handle, batch_size=1, inputs=[wire_pb2.Tensor(
            offset=offset, nbytes=8, shape=[1, 2])])]))
    return offset


def result(front: FakeFrontEnd, rid: int) -> wire_pb2.Result:
    frame = front.read_until(lambda f: any(r.rid == rid for r in f.results)
                             or any(rid in b.rids for b in f.batches))
    found = [r for r in [*frame.results,
                         *(r for b in frame.batches for r in wire.batch_results(b))]
             if r.rid == rid]
    return found[0]


def output_of(arena: SharedArena, answer: wire_pb2.Result) -> list[float]:
    (output,) = answer.outputs
    return np.frombuffer(bytes(arena.read(output.offset, output.nbytes)), np.float32).tolist()


def test_a_lost_connections_output_blocks_wait_for_its_process_before_reuse(executor):
    """Front end 0's answer (block X, its client's 2.0s) is still being copied when its
    connection is lost; front end 1's next answer must not go into X, whose bytes stay 0's
    client's. X is reused only once front end 0's process says Hello again."""
    arena = executor.arena
    first = FakeFrontEnd(executor.name, 0)
    other = FakeFrontEnd(executor.name, 1)
    _, handle = welcomed(first)
    welcomed(other)
    send(first, arena, handle, 1, 1.0)
    mine = result(first, 1)
    assert output_of(arena, mine) == [2.0, 2.0]
    first.close()  # lost, its block not returned (a copy under way)
    executor.wait_for("frontend_disconnected")
    send(other, arena, handle, 1, 7.0)
    theirs = result(other, 1)
    assert output_of(arena, theirs) == [14.0, 14.0]
    assert theirs.outputs[0].block != mine.outputs[0].block
    assert output_of(arena, mine) == [2.0, 2.0]  # the client of front end 0 got its own bytes
    # The same process connects again: done with its copies, the block is the executor's again.
    again = FakeFrontEnd(executor.name, 0)
    welcomed(again)
    (reused,) = executor.wait_for("frontend_outputs_reused")
    assert reused["blocks"] == 1
    send(again, arena, handle, 2, 3.0)
    assert output_of(arena, result(again, 2)) == [6.0, 6.0]
    for front in (again, other):
        front.close()


def test_a_lost_connections_output_blocks_are_reused_once_its_process_exits(executor, tmp_path):
    """A front-end process that never comes back: its blocks are reused when it exits."""
    arena = executor.arena
    script = tmp_path / "front_end.py"
    script.write_text(textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {ROOT!r})
        from tests.support.wire_peers import FakeFrontEnd
        from batchgate.protos import wire_pb2
        front = FakeFrontEnd({executor.name!r}, 0)
        welcome = front.read_until(lambda f: f.welcome)
        handle = [m.handle for m in welcome.models if m.name == "gated"][0]
        front.write(wire_pb2.ToExecutor(infer=[wire_pb2.Infer(
            rid=1, model=handle, batch_size=1, inputs=[wire_pb2.Tensor(
                offset={ArenaLayout(arena.size, SLOTS).input_region(0)[0]}, nbytes=8,
                shape=[1, 2])])]))
        front.read_until(lambda f: len(f.results) or len(f.batches))
        print("answered", flush=True)
        sys.stdin.readline()
    '''))
    child = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "answered"
        assert not executor.events("frontend_outputs_reused")
        child.stdin.close()  # it exits; its connection goes with it
        child.wait(30)
        (reused,) = executor.wait_for("frontend_outputs_reused")
        assert reused["pid"] == child.pid and reused["blocks"] == 1
    finally:
        if child.poll() is None:
            child.kill()


def test_inputs_a_running_batch_reads_are_held_across_a_reconnect(executor, gate):
    """A batch is running on front end 0's request when its connection is lost: the welcome of
    its next connection lists the request's input block as held, and released_inputs names it
    once the batch ends. Meanwhile a new request of the same front end is served."""
    arena = executor.arena
    gate.close()
    first = FakeFrontEnd(executor.name, 0)
    _, handle = welcomed(first)
    offset = send(first, arena, handle, 1, 1.0)
    gate.wait_entered()
    first.close()
    executor.wait_for("frontend_disconnected")
    again = FakeFrontEnd(executor.name, 0)
    welcome, handle = welcomed(again)
    assert [(b.offset, b.nbytes) for b in welcome.held] == [(offset, 8)]
    elsewhere = offset + 256  # what a front end would take: not the held block
    send(again, arena, handle, 2, 5.0, elsewhere)
    gate.open()
    released, answers = [], {}
    while not released or 2 not in answers:
        frame = again.read()
        released += frame.released_inputs
        answers.update({r.rid: r for r in frame.results})
        answers.update({r.rid: r for b in frame.batches for r in wire.batch_results(b)})
    assert released == [offset]
    assert output_of(arena, answers[2]) == [10.0, 10.0]
    # Nothing is held any more: a later welcome lists nothing.
    again.close()
    executor.wait_for("frontend_disconnected", 2)
    last = FakeFrontEnd(executor.name, 0)
    welcome, _ = welcomed(last)
    assert not welcome.held
    last.close()


def test_a_restarted_executor_welcomes_no_front_end_before_its_predecessors_are_done(
        tmp_path, gate):
    """An executor handed the pids of live front ends (a restart) answers a Hello, and what
    follows it, but welcomes only once each of those front ends has said Hello or exited."""
    repository = tmp_path / "models"
    write_model(repository, with_parameters(GATED_CONFIG, gate_dir=gate.dir), GATED_MODEL)
    predecessor = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                   stdin=subprocess.PIPE)
    arena = SharedArena.create(ARENA_BYTES)
    process = ExecutorProcess(arena, repository, slots=SLOTS,
                              frontend_pids={0: predecessor.pid})
    try:
        front = FakeFrontEnd(process.name, 1)
        front.write(wire_pb2.ToExecutor(call=[wire_pb2.Call(
            cid=7, index=pb.RepositoryIndexRequest())]))
        first = front.read()
        assert [r.cid for r in first.replies] == [7] and not first.welcome
        predecessor.stdin.close()
        predecessor.wait(30)
        welcome, _ = welcomed(front)
        assert welcome.welcome
        front.close()
    finally:
        if predecessor.poll() is None:
            predecessor.kill()
        process.stop()
        arena.close()
