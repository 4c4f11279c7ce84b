"""(d) a batch's input time on the device, from CUDA events on its instance's copy stream, and
its forward's, from events on the stream it runs on.

The executor's statistics time the assembly on the host (``compute_input``): the host returns
once the copies are queued, and what the copy stream then spends lands in the forward's figure,
whose stream waits for it. ``CopyStreamProbe`` records an event on the copy stream before and
after each batch's assembly and one on the forward's stream before and after its forward, so
that the device's own clock says how long the inputs took to be ready and how long the forward
ran. The executor has no hook for it: the probe wraps the instance's assembly and forward in
place (attributes of today's ``Executor``), and says so when they are not there.
"""

from __future__ import annotations

import statistics
import threading
from typing import Any


class ProbeUnavailable(RuntimeError):
    """The executor does not have what the probe wraps."""


class CopyStreamProbe:
    """Per batch: (copy start, copy end) on the copy stream, (forward start, forward end) on the
    forward's stream, as timing events. Install after warm-up so only served batches count."""

    def __init__(self, executors: list[Any]) -> None:
        self._lock = threading.Lock()
        self._copies: dict[int, tuple[Any, Any]] = {}  # id(batch) -> its copy events
        self.batches: list[tuple[Any, Any, Any, Any]] = []
        for executor in executors:
            self._install(executor)

    def _install(self, executor: Any) -> None:
        import torch

        assembly = getattr(executor, "_assembly", None)
        model = getattr(executor, "_model", None)
        copy_stream = getattr(executor, "_copy_stream", None)
        if assembly is None or model is None or copy_stream is None:
            raise ProbeUnavailable("the executor has no _assembly, _model or _copy_stream to "
                                   "time (bench/gpu_check/copy_events.py needs updating)")
        assemble, run = assembly.assemble, model.run

        def timed_assemble(batch: Any, graphs: Any) -> None:
            start = torch.cuda.Event(enable_timing=True)
            start.record(copy_stream)
            assemble(batch, graphs)
            end = torch.cuda.Event(enable_timing=True)
            end.record(copy_stream)
            with self._lock:
                self._copies[id(batch)] = (start, end)

        def timed_run(batch: Any) -> Any:
            stream = torch.cuda.current_stream()  # the compute or replay stream, inputs waited
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            outputs = run(batch)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            with self._lock:
                copy = self._copies.pop(id(batch), None)
                if copy is not None:
                    self.batches.append((*copy, start, end))
            return outputs

        assembly.assemble = timed_assemble
        model.run = timed_run

    def figures(self) -> dict[str, Any]:
        """Medians over the batches (ms): the copy stream's time from the assembly's start to
        the inputs being ready, the forward's, the copy's share of the two (as if nothing
        overlapped: the upper bound of what the copy adds to a batch), and the part of the copy
        during which the forward's stream had finished the previous batch (exposed: what the
        compute actually waited). Call after the batches' work has completed."""
        with self._lock:
            batches = list(self.batches)
        if not batches:
            return {"batches": 0}
        copy_ms, forward_ms, exposed_ms = [], [], []
        previous_end = None
        for copy_start, copy_end, forward_start, forward_end in batches:
            copy_ms.append(copy_start.elapsed_time(copy_end))
            forward_ms.append(forward_start.elapsed_time(forward_end))
            # Events on different streams of one device share its clock.
            if previous_end is None:
                exposed_ms.append(copy_ms[-1])
            else:
                since_free = previous_end.elapsed_time(copy_end)  # < 0: ready before free
                exposed_ms.append(max(0.0, min(copy_ms[-1], since_free)))
            previous_end = forward_end
        copy, forward = statistics.median(copy_ms), statistics.median(forward_ms)
        exposed = statistics.median(exposed_ms)
        return {"batches": len(batches), "copy_ms": copy, "forward_ms": forward,
                "exposed_ms": exposed, "share": copy / (copy + forward) if copy + forward else 0.0,
                "exposed_share": exposed / (exposed + forward) if exposed + forward else 0.0}
