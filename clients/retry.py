"""When to try a call again, and how long to wait first."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from batchgate.clients.errors import BatchgateError


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for idempotent calls.

    Applies to health, ready, metadata, config, statistics, repository index and `infer` (unless
    called with `idempotent=False`); never to load/unload or streams. A retry goes to the next
    address of the client, and never outlives the call's deadline. `RetryPolicy(max_attempts=1)`
    turns retries off.
    """

    max_attempts: int = 3
    """Attempts in all, the first included; at least 1."""
    initial_backoff_s: float = 0.05
    """Wait before the first retry, in seconds."""
    max_backoff_s: float = 1.0
    """Upper bound of any one wait, in seconds."""
    multiplier: float = 2.0
    """Growth of the wait from one retry to the next; at least 1."""
    jitter: float = 0.2
    """Each wait is scaled by a random factor in [1 - jitter, 1 + jitter]; 0 ≤ jitter ≤ 1."""
    retry_on: frozenset[grpc.StatusCode] = field(
        default=frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
    )
    """Status codes worth another attempt. CANCELLED is there because a server that is
    stopping cancels the calls that reach it at its last moment (seen behind nginx during
    rolling restarts); a call the caller itself cancels ends without a retry."""

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise TypeError(f"max_attempts must be an int, got {self.max_attempts!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if not self.initial_backoff_s >= 0:
            raise ValueError(f"initial_backoff_s must be >= 0, got {self.initial_backoff_s}")
        if not self.max_backoff_s >= self.initial_backoff_s:
            raise ValueError(
                f"max_backoff_s must be >= initial_backoff_s ({self.initial_backoff_s}), "
                f"got {self.max_backoff_s}"
            )
        if not self.multiplier >= 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")
        codes = self.retry_on
        if isinstance(codes, grpc.StatusCode) or not isinstance(codes, Iterable):
            raise TypeError(f"retry_on must be a collection of grpc.StatusCode, got {codes!r}")
        codes = frozenset(codes)
        bad = [c for c in codes if not isinstance(c, grpc.StatusCode) or c is grpc.StatusCode.OK]
        if bad:
            raise ValueError(f"retry_on must hold grpc.StatusCode values other than OK, got {bad}")
        object.__setattr__(self, "retry_on", codes)

    def backoff_s(self, retry: int, rng: random.Random | None = None) -> float:
        """The wait before retry number `retry` (1 for the first retry), jitter included."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (retry - 1))
        if self.jitter == 0:
            return base
        return base * (1 + (rng or random).uniform(-self.jitter, self.jitter))


class RetrySchedule:
    """The attempts of one call: the policy, bounded by the call's overall deadline."""

    def __init__(self, policy: RetryPolicy, *, idempotent: bool, timeout_s: float | None) -> None:
        self._policy = policy
        self._max_attempts = policy.max_attempts if idempotent else 1
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.attempts = 0

    def start_attempt(self) -> float | None:
        """Count an attempt; return its gRPC timeout in seconds (None: no deadline)."""
        self.attempts += 1
        if self._deadline is None:
            return None
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise BatchgateError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return remaining

    def backoff_s(self, error: BatchgateError) -> float | None:
        """How long to wait before trying again after `error`; None: give up and raise it."""
        if error.code not in self._policy.retry_on or self.attempts >= self._max_attempts:
            return None
        delay = self._policy.backoff_s(self.attempts)
        # Waiting past the deadline would only turn the real error into DEADLINE_EXCEEDED.
        if self._deadline is not None and time.monotonic() + delay >= self._deadline:
            return None
        return delay
