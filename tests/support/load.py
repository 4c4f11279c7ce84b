"""Load on a running server from threads, every answer checked."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from tests.support.models import reference
from tests.support.polling import poll


class Load:
    """Closed-loop SDK clients on threads, inferring the example ``mlp``: every answer checked,
    final failures counted by status code. Each client has its own connection (gRPC shares one
    per target otherwise), so load balancers and SO_REUSEPORT spread them. Bounded in time:
    clients stop after ``max_s`` whatever happens."""

    def __init__(self, address: str, clients: int = 8, retry=None, max_s: float = 120,
                 seed: int = 0) -> None:
        """``seed`` draws the input every client of this load sends (loads of different seeds
        tell their answers apart)."""
        from batchgate.clients import RetryPolicy

        self.address = address
        self.max_s = max_s
        self.retry = retry or RetryPolicy(max_attempts=1)
        self.ok = 0
        self.wrong = 0
        self.failures: collections.Counter = collections.Counter()
        self.failure_details: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._x = np.random.default_rng(seed).standard_normal((1, 512), dtype=np.float32)
        self._expected = reference("mlp", self._x)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]

    def _run(self) -> None:
        from batchgate.clients import BatchgateError, Client

        with Client(self.address, timeout_s=10, retry=self.retry,
                    options=[("grpc.use_local_subchannel_pool", 1)]) as client:
            deadline = time.monotonic() + self.max_s
            while not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    out = client.infer("mlp", {"INPUT__0": self._x})["OUTPUT__0"]
                except BatchgateError as exc:
                    with self._lock:
                        self.failures[exc.code] += 1
                        self.failure_details.append(str(exc)[:200])
                    continue
                good = np.allclose(out, self._expected, rtol=1e-4, atol=1e-5)
                with self._lock:
                    self.ok += 1 if good else 0
                    self.wrong += 0 if good else 1

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def answered(self) -> int:
        with self._lock:
            return self.ok

    def progress(self, more: int, timeout_s: float, what: str) -> int:
        """Wait until ``more`` further answers came; return how many did."""
        start = self.answered()
        poll(lambda: self.answered() >= start + more, timeout_s, what)
        return self.answered() - start
