"""An executor's warm-up: every sample run through the real batch path on the model thread,
each batch size timed for the latency profile, then the CUDA graphs captured per bucket.

``Executor`` (``batcher/executor.py``) takes these methods from ``ExecutorWarmup``; they run
as the model thread's first jobs, before it serves.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from batchgate.batcher import graphs as cuda_graphs
from batchgate.batcher.batch import Batch
from batchgate.batcher.errors import exception_summary
from batchgate.batcher.request import InferenceRequest

log = structlog.get_logger(__name__)


class ExecutorWarmup:
    """How ``Executor`` warms up and captures its graphs."""

    def warm_up(self, samples: Sequence[Sequence[np.ndarray]]) -> dict[str, Any]:
        """Run each input set through the batch path (slot buffers, padding, precision) on the
        instance's model thread (started here, configured as it serves); then capture the CUDA
        graphs, if planned.

        Returns ``batch_sizes`` (rows each run had, padding included), ``activation_bytes``
        (where the model's memory is measured: what the instance's compute pool holds after
        the runs, its peak, since the pool keeps its segments; else None), ``graphs`` (what
        became of the CUDA graphs, "" when none were planned) and ``timed`` ((rows, seconds) of
        a second run per batch size). Raises what a run raised; out of memory is not split
        here: a model that does not fit must not load.
        """
        report: dict[str, Any] = {"batch_sizes": [], "activation_bytes": None, "graphs": "",
                                  "timed": []}
        failure: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            self._model.warming = True
            try:
                for arrays in samples:
                    report["batch_sizes"].append(self._warm_one(arrays))
                if self._plan.graph_buffers is not None:
                    report["graphs"] = self._capture_graphs()
                self._sync_streams()
                report["timed"] = self._timed_runs(samples)
                if self._memory.measures:
                    report["activation_bytes"] = self._memory.reserved(self._compute_role)
            except BaseException as exc:  # reported to the loader below
                failure.append(exc)
            finally:
                self._model.warming = False
                done.set()

        self._start_model_thread()
        self._model_jobs.put(run)
        done.wait()
        if failure:
            raise failure[0]
        return report

    def _warm_one(self, arrays: Sequence[np.ndarray]) -> int:
        rows = arrays[0].shape[0] if self._batching and arrays else 1
        request = InferenceRequest([np.array(a) for a in arrays], batch_size=rows)
        batch = Batch(0, [request], "warmup")
        batch.slot = self._plan.slots[0]
        self._assemble(batch)
        self._launch(batch)
        if batch.done is not None:
            batch.done.synchronize()
        batch.device_outputs = None
        return batch.bucket

    def _timed_runs(self, samples: Sequence[Sequence[np.ndarray]]) -> list[tuple[int, float]]:
        """(rows, seconds) of a second, warm run per batch size (on its CUDA graph when one was
        captured): what the model's latency profile starts from (batcher/profile.py)."""
        timed, seen = [], set()
        for arrays in samples:
            rows = arrays[0].shape[0] if self._batching and arrays else 1
            if rows in seen:
                continue
            seen.add(rows)
            started = time.perf_counter()
            self._warm_one(arrays)
            timed.append((rows, time.perf_counter() - started))
        return timed

    def _capture_graphs(self) -> str:
        static_inputs, static_outputs = self._plan.graph_buffers
        graphs = cuda_graphs.BucketGraphs(
            self._device, lambda inputs, capturing: self._model.forward(inputs, len(inputs[0]),
                                                                  capturing=capturing),
            static_inputs, static_outputs, memory=self._memory, instance=self._index)
        try:
            graphs.capture()
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._memory.allocator.synchronize(graphs.capture_stream)
            reason = exception_summary(exc)
            log.warning("cuda_graphs_failed", model=self._spec.name, instance=self._index,
                        reason=reason, running="eager")
            return f"eager: capture failed ({reason})"
        self._model.graphs = graphs
        log.info("cuda_graphs_captured", model=self._spec.name, instance=self._index,
                 buckets=list(graphs.buckets))
        return f"captured for buckets {','.join(map(str, graphs.buckets))}"
