"""The server addresses a client talks to, one channel each, and which one a call uses."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

E = TypeVar("E")


def parse_addresses(address: str | Sequence[str]) -> list[str]:
    """One address or a list of them, as a non-empty list of "host:port" strings."""
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError("at least one address is needed, got an empty list")
    for a in addresses:
        if not isinstance(a, str) or not a:
            raise TypeError(f"addresses must be non-empty 'host:port' strings, got {a!r}")
    return addresses


def channel_options(
    max_message_bytes: int, extra: Sequence[tuple[str, Any]] = ()
) -> list[tuple[str, Any]]:
    """gRPC channel arguments: message size limits both ways, then the caller's own."""
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int):
        raise TypeError(f"max_message_bytes must be an int, got {max_message_bytes!r}")
    if not 0 < max_message_bytes < 2**31:
        raise ValueError(f"max_message_bytes must be in (0, 2**31), got {max_message_bytes}")
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *extra,
    ]


def check_timeout_s(timeout_s: float | None) -> float | None:
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
    return timeout_s


class EndpointPool(Generic[E]):
    """Round-robin over the endpoints; a retry moves on to the next one.

    The place where health-aware balancing will choose among endpoints: callers only ask for
    `first()` and `following(index)`.
    """

    def __init__(self, endpoints: Sequence[E]) -> None:
        self._endpoints = list(endpoints)
        # next() on itertools.count is atomic under the GIL, so threads share it without a lock.
        self._turn = itertools.count()

    def __len__(self) -> int:
        return len(self._endpoints)

    def __getitem__(self, index: int) -> E:
        return self._endpoints[index]

    def __iter__(self):
        return iter(self._endpoints)

    def first(self) -> int:
        """The endpoint a new call starts on."""
        return next(self._turn) % len(self._endpoints)

    def following(self, index: int) -> int:
        """The endpoint a retry of a call that failed on `index` goes to."""
        return (index + 1) % len(self._endpoints)
