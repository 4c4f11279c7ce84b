"""The engine: asyncio senders over raw gRPC calls, on a thread or in spawned worker processes.

The hot path sends pre-serialized bytes through ``channel.unary_unary`` with no serializer and
no deserializer: no protobuf is built or parsed per request, and only the call's status code is
kept. Each request leaves one record: intended send time, actual send time, answer time, status
code, and which variant was sent. Open-loop latency is answer minus *intended* time.

One worker is one event loop with its own channel per target. ``--workers N`` runs N of them as
spawned processes (forking a process whose threads are inside gRPC is not safe); one worker
runs on a thread of the calling process. The parent starts every step at one moment on the
system-wide monotonic clock, and each worker reports its records when the step has drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.sharedctypes import RawArray

import grpc
import numpy as np

from batchgate.bench.loadgen.plan import Segment, Step, split

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
CANCELLED = grpc.StatusCode.CANCELLED.value[0]
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    # Each worker's channel gets its own connection, as separate clients would.
    ("grpc.use_local_subchannel_pool", 1),
)
STEP_LEAD_S = 0.2  # time for the step's plan to reach every worker before it starts
READY_TIMEOUT_S = 60.0


class DriverError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class DriverConfig:
    urls: tuple[str, ...]
    payloads: tuple[bytes, ...]
    call_timeout_s: float = 60.0
    # Per payload: its gRPC deadline, from its intended time (None: call_timeout_s). Empty: none.
    deadlines_s: tuple[float | None, ...] = ()
    max_outstanding: int | None = None  # open loop: requests in flight per worker
    drain_timeout_s: float = 60.0
    connect_timeout_s: float = 30.0


@dataclasses.dataclass
class SegmentRecords:
    """One worker's records of one segment; times in seconds from the step's start."""

    target: int
    measured: bool
    start_s: float
    end_s: float  # closed loop: when the senders stopped starting calls; open: the last arrival
    intended: np.ndarray
    sent: np.ndarray
    done: np.ndarray
    code: np.ndarray
    choice: np.ndarray


@dataclasses.dataclass
class StepRecords:
    segments: list[SegmentRecords]
    cpu_s: float  # the worker process's CPU time over the step
    wall_s: float  # the step's length, warm-up and drain included


class _Recorder:
    """Per-request records as plain lists: appends are the cheapest thing on the hot path."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.intended: list[float] = []
        self.sent: list[float] = []
        self.done: list[float] = []
        self.code: list[int] = []
        self.choice: list[int] = []
        self.start = self.end = 0.0

    def result(self, origin: float) -> SegmentRecords:
        intended = np.asarray(self.intended, dtype=np.float64) - origin
        sent = np.asarray(self.sent, dtype=np.float64) - origin if self.sent else intended
        return SegmentRecords(
            self.segment.target, self.segment.measured, self.start - origin, self.end - origin,
            intended, sent, np.asarray(self.done, dtype=np.float64) - origin,
            np.asarray(self.code, dtype=np.int16), np.asarray(self.choice, dtype=np.int32))


class _StepRunner:
    """Runs one worker's share of one step on the running loop."""

    def __init__(self, config: DriverConfig, calls: Sequence, progress, origin: float) -> None:
        self.config = config
        self.calls = calls
        self.progress = progress
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.inflight: set[asyncio.Task] = set()
        self.slots = (asyncio.Semaphore(config.max_outstanding)
                      if config.max_outstanding else None)

    async def run(self, step: Step) -> StepRecords:
        cpu = time.process_time()
        await asyncio.sleep(max(0.0, self.origin - time.monotonic()))
        recorders = []
        shift, target = 0.0, None
        for segment in step.segments:
            recorder = _Recorder(segment)
            recorders.append(recorder)
            if segment.closed:
                await self._closed(segment, recorder)
                continue
            if target is not None and segment.target != target:
                # A server's backlog must not run during the other's slice: wait for it, and
                # lay the rest of the schedule that much later.
                await self._drain()
                shift = max(shift, time.monotonic() - (self.origin + segment.start_s))
            target = segment.target
            await self._open(segment, recorder, self.origin + shift)
        await self._drain()
        return StepRecords([r.result(self.origin) for r in recorders], time.process_time() - cpu,
                           time.monotonic() - self.origin)

    async def _closed(self, segment: Segment, rec: _Recorder) -> None:
        rec.start = time.monotonic()
        end = rec.start + segment.duration_s if segment.duration_s is not None else float("inf")
        budget = [segment.requests if segment.requests is not None else -1]
        call, payloads = self.calls[segment.target], self.config.payloads
        choices = segment.choices.tolist()
        cycle = len(choices)
        timeouts = self._timeouts()
        progress = self.progress
        intended, done, codes, chosen = rec.intended, rec.done, rec.code, rec.choice

        async def sender(position: int) -> None:
            clock = time.monotonic
            while True:
                t0 = clock()
                if t0 >= end or budget[0] == 0:
                    return
                budget[0] -= 1
                i = choices[position]
                position = (position + 1) % cycle
                code = CANCELLED  # what a cancelled call (the drain's time limit) counts as
                try:
                    await call(payloads[i], timeout=timeouts[i])
                    code = 0
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().value[0]
                finally:
                    intended.append(t0)
                    done.append(clock())
                    codes.append(code)
                    chosen.append(i)
                    progress[0] += 1
                    if code:
                        progress[1] += 1

        senders = [self.loop.create_task(sender(k * cycle // max(1, segment.concurrency)))
                   for k in range(segment.concurrency)]
        if senders:
            limit = None if end == float("inf") else end - time.monotonic() + self.config.drain_timeout_s
            _done, pending = await asyncio.wait(senders, timeout=limit)
            await _cancel(pending)
        rec.end = end if segment.duration_s is not None else max(rec.intended, default=rec.start)

    def _timeouts(self) -> list[float]:
        """Each payload's call timeout: its deadline, or ``call_timeout_s`` without one."""
        deadlines = self.config.deadlines_s or (None,) * len(self.config.payloads)
        return [d if d is not None else self.config.call_timeout_s for d in deadlines]

    async def _open(self, segment: Segment, rec: _Recorder, origin: float) -> None:
        """Send ``segment``'s arrivals on schedule, ``origin`` being the step's start (later
        than the step's own when an earlier slice was drained)."""
        rec.start = origin + segment.start_s
        call = self.calls[segment.target]
        slots, clock = self.slots, time.monotonic
        for t, i in zip((origin + segment.times).tolist(), segment.choices.tolist()):
            if slots is not None:
                await slots.acquire()
            delay = t - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            task = self.loop.create_task(self._one(call, t, i, rec))
            self.inflight.add(task)
            task.add_done_callback(self.inflight.discard)
        if segment.duration_s is not None:
            rec.end = rec.start + segment.duration_s
        else:
            rec.end = origin + (segment.times[-1] if segment.times.size else segment.start_s)

    async def _one(self, call, intended: float, i: int, rec: _Recorder) -> None:
        sent = time.monotonic()
        code = CANCELLED
        try:
            deadlines = self.config.deadlines_s
            deadline_s = deadlines[i] if deadlines else None
            timeout = self.config.call_timeout_s
            if deadline_s is not None:
                timeout = deadline_s - (sent - intended)
            if timeout <= 0:  # already past its deadline: a client with one would not send it
                code = DEADLINE_EXCEEDED
            else:
                await call(self.config.payloads[i], timeout=timeout)
                code = 0
        except grpc.aio.AioRpcError as exc:
            code = exc.code().value[0]
        finally:
            if self.slots is not None:
                self.slots.release()
            rec.intended.append(intended)
            rec.sent.append(sent)
            rec.done.append(time.monotonic())
            rec.code.append(code)
            rec.choice.append(i)
            self.progress[0] += 1
            if code:
                self.progress[1] += 1

    async def _drain(self) -> None:
        if self.inflight:
            _done, pending = await asyncio.wait(list(self.inflight),
                                                timeout=self.config.drain_timeout_s)
            await _cancel(pending)


async def _cancel(tasks) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# -- one worker ---------------------------------------------------------------------------------


def worker_main(config: DriverConfig, conn, progress) -> None:
    """A worker's life: connect, say ready, then run each step it is sent until told to stop."""
    asyncio.run(_worker(config, conn, progress))


async def _worker(config: DriverConfig, conn, progress) -> None:
    loop = asyncio.get_running_loop()
    channels = [grpc.aio.insecure_channel(url, options=CHANNEL_OPTIONS) for url in config.urls]
    try:
        for url, channel in zip(config.urls, channels):
            try:
                await asyncio.wait_for(channel.channel_ready(), config.connect_timeout_s)
            except asyncio.TimeoutError:
                conn.send(("error", f"cannot connect to {url} within {config.connect_timeout_s:g} s"))
                return
        calls = [channel.unary_unary(MODEL_INFER) for channel in channels]
        conn.send(("ready", None))
        while True:
            message = await loop.run_in_executor(None, conn.recv)
            if message is None:
                return
            origin, step = message
            try:
                records = await _StepRunner(config, calls, progress, origin).run(step)
            except Exception:  # reported to the parent, which stops the run and says why
                conn.send(("error", traceback.format_exc()))
                return
            conn.send(("records", records))
    finally:
        for channel in channels:
            await channel.close()


# -- the parent's side --------------------------------------------------------------------------


Progress = Callable[[int, int], None]


class Workers:
    """``count`` workers: spawned processes, or one thread here when ``count`` is 1 and
    ``in_process``. Use as a context manager; ``run_step`` runs one step on all of them."""

    def __init__(self, config: DriverConfig, count: int = 1, *, in_process: bool = True) -> None:
        if count < 1:
            raise ValueError(f"workers must be >= 1, got {count}")
        self.config = config
        self.count = count
        self.in_process = in_process and count == 1
        self.progress = [RawArray("q", 2) for _ in range(count)]
        self._conns: list = []
        self._runners: list = []

    def __enter__(self) -> Workers:
        context = multiprocessing.get_context("spawn")
        for w in range(self.count):
            parent, child = multiprocessing.Pipe()
            args = (self.config, child, self.progress[w])
            if self.in_process:
                runner = threading.Thread(target=worker_main, args=args, name="bench-worker",
                                          daemon=True)
            else:
                runner = context.Process(target=worker_main, args=args, name=f"bench-worker-{w}",
                                         daemon=True)
            runner.start()
            if not self.in_process:
                child.close()  # the process has its copy: its exit then reads as end of file here
            self._conns.append(parent)
            self._runners.append(runner)
        for conn in self._conns:
            kind, detail = self._receive(conn, READY_TIMEOUT_S + self.config.connect_timeout_s)
            if kind != "ready":
                raise DriverError(detail)
        return self

    def __exit__(self, *exc) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for runner in self._runners:
            runner.join(self.config.drain_timeout_s + 10)
            if isinstance(runner, multiprocessing.process.BaseProcess) and runner.is_alive():
                runner.kill()

    def answered(self) -> tuple[int, int]:
        """Answers and errors so far, over all workers."""
        return (sum(p[0] for p in self.progress), sum(p[1] for p in self.progress))

    def run_step(self, step: Step, origin: float, on_progress: Progress | None = None,
                 poll_s: float = 0.2) -> list[StepRecords]:
        """Run ``step`` from ``origin`` (monotonic seconds, a little ahead: the plan has to
        reach every worker first); returns each worker's records."""
        for conn, share in zip(self._conns, split(step, self.count)):
            conn.send((origin, share))
        results: dict[int, StepRecords] = {}
        waiting = dict(enumerate(self._conns))
        while waiting:
            ready = multiprocessing.connection.wait(list(waiting.values()), timeout=poll_s)
            for w, conn in list(waiting.items()):
                if conn in ready:
                    kind, detail = self._receive(conn, 0)
                    if kind != "records":
                        raise DriverError(f"worker {w}: {detail}")
                    results[w] = detail
                    del waiting[w]
            if on_progress is not None:
                on_progress(*self.answered())
        return [results[w] for w in range(self.count)]

    def _receive(self, conn, timeout_s: float):
        if not conn.poll(timeout_s):
            raise DriverError(f"a worker said nothing within {timeout_s:g} s")
        try:
            return conn.recv()
        except EOFError:
            return ("error", "a worker exited before reporting")
