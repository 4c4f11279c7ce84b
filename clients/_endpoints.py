"""The server addresses a client talks to, one channel each, and which one a call uses.

`AddressSource` knows what the client was given (addresses, or names to resolve) and when to
resolve them again; `EndpointPool` holds one endpoint (channel) per current address, with the
health of each, and chooses where a call or a retry goes.
"""

from __future__ import annotations

import itertools
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from batchgate.clients.errors import BatchgateError

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_RESOLVE_INTERVAL_S = 30.0
DEFAULT_UNHEALTHY_FOR_S = 2.0
MAX_UNHEALTHY_FOR_S = 30.0
"""The longest cool-down: repeated failures double it up to this."""
MIN_RERESOLVE_GAP_S = 1.0
"""Re-resolving because every address failed happens at most this often."""
DNS_PREFIX = "dns:///"

E = TypeVar("E")

Resolver = Callable[[str], Sequence[str]]
"""Takes "host:port", returns the "ip:port" addresses it stands for."""


def parse_addresses(address: str | Sequence[str]) -> list[str]:
    """One address or a list of them, as a non-empty list of "host:port" strings."""
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError("at least one address is needed, got an empty list")
    for a in addresses:
        if not isinstance(a, str) or not a:
            raise TypeError(f"addresses must be non-empty 'host:port' strings, got {a!r}")
    return addresses


def split_host_port(target: str) -> tuple[str, int]:
    """Split "host:port" or "[v6]:port" into (host, port)."""
    host, _, port = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an address to resolve must be 'host:port', got {target!r}")
    return host, int(port)


def resolve_dns(target: str) -> list[str]:
    """Every A/AAAA record of "host:port", as "ip:port" / "[ip6]:port", in resolver order."""
    host, port = split_host_port(target)
    found: list[str] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = sockaddr[0]
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in found:
            found.append(address)
    return found


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


def check_unhealthy_for_s(unhealthy_for_s: float) -> float:
    if isinstance(unhealthy_for_s, bool) or not isinstance(unhealthy_for_s, (int, float)):
        raise TypeError(f"unhealthy_for_s must be a number, got {unhealthy_for_s!r}")
    if not 0 <= unhealthy_for_s <= MAX_UNHEALTHY_FOR_S:
        raise ValueError(
            f"unhealthy_for_s must be in [0, {MAX_UNHEALTHY_FOR_S:g}], got {unhealthy_for_s}"
        )
    return float(unhealthy_for_s)


class ResolveError(Exception):
    """A name could not be resolved to any address."""


class AddressSource:
    """The addresses a client was given, resolving the names among them, and when to re-resolve.

    A target is resolved when it is written "dns:///host:port", or when `resolve` is true. With
    nothing to resolve, `due()` is true only while the pool is empty (to open it once).
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        resolve: bool = False,
        resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(resolve, bool):
            raise TypeError(f"resolve must be a bool, got {resolve!r}")
        if isinstance(resolve_interval_s, bool) or not isinstance(resolve_interval_s, (int, float)):
            raise TypeError(f"resolve_interval_s must be a number, got {resolve_interval_s!r}")
        if not 0 < resolve_interval_s < math.inf:
            raise ValueError(f"resolve_interval_s must be > 0 and finite, got {resolve_interval_s}")
        if resolver is not None and not callable(resolver):
            raise TypeError(f"resolver must be callable or None, got {resolver!r}")
        self.targets: list[tuple[str, bool]] = []
        for target in parse_addresses(address):
            if target.startswith("dns:"):
                if not target.startswith(DNS_PREFIX):
                    raise ValueError(
                        f"a DNS target must be 'dns:///host:port' (no DNS server), got {target!r}"
                    )
                target = target[len(DNS_PREFIX) :]
                split_host_port(target)
                self.targets.append((target, True))
            else:
                if resolve:
                    split_host_port(target)
                self.targets.append((target, resolve))
        self.dynamic = any(resolved for _, resolved in self.targets)
        self._interval_s = float(resolve_interval_s)
        self._resolver = resolver or resolve_dns
        self._clock = clock
        self._lock = threading.Lock()
        self._last = -math.inf
        self._next = -math.inf

    def due(self, *, empty: bool, all_unhealthy: bool) -> bool:
        """Whether to resolve now; a true answer counts as the resolution having started."""
        if empty:
            return True
        if not self.dynamic:
            return False
        with self._lock:
            now = self._clock()
            gap_s = min(MIN_RERESOLVE_GAP_S, self._interval_s)
            if now >= self._next or (all_unhealthy and now >= self._last + gap_s):
                self._last, self._next = now, now + self._interval_s
                return True
            return False

    def resolve(self) -> list[str]:
        """The current addresses of every target (blocking); ResolveError if one has none."""
        addresses: list[str] = []
        for target, resolved in self.targets:
            if not resolved:
                found = [target]
            else:
                try:
                    found = list(self._resolver(target))
                except Exception as exc:  # the resolver is the caller's code, or getaddrinfo
                    raise ResolveError(f"cannot resolve {target!r}: {exc}") from exc
                if not found:
                    raise ResolveError(f"cannot resolve {target!r}: no addresses")
                for a in found:
                    if not isinstance(a, str) or not a:
                        raise ResolveError(
                            f"the resolver must return 'host:port' strings, got {a!r}"
                        )
            addresses.extend(a for a in found if a not in addresses)
        return addresses


@dataclass(eq=False)
class _Slot(Generic[E]):
    endpoint: E
    failures: int = 0
    unhealthy_until: float = -math.inf
    in_flight: int = 0


class EndpointPool(Generic[E]):
    """Round robin over the healthy endpoints; a retry moves on to the next healthy one.

    An endpoint whose call failed with UNAVAILABLE is unhealthy for `unhealthy_for_s`, doubled
    on each further failure up to MAX_UNHEALTHY_FOR_S, and skipped while any endpoint is
    healthy; when none is, the one whose cool-down ends first is used. A success clears it.
    `update()` replaces the set of addresses, keeping the endpoints of those that remain.
    Thread-safe.
    """

    def __init__(
        self,
        open_endpoint: Callable[[str], E],
        *,
        unhealthy_for_s: float = DEFAULT_UNHEALTHY_FOR_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._open = open_endpoint
        self._unhealthy_for_s = check_unhealthy_for_s(unhealthy_for_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot[E]] = {}  # in round-robin order
        self._retired: list[_Slot[E]] = []  # removed, with calls still in flight
        # next() on itertools.count is atomic under the GIL, so threads share it without a lock.
        self._turn = itertools.count()

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def addresses(self) -> list[str]:
        return list(self._slots)

    def unhealthy(self) -> list[str]:
        """The addresses in their cool-down now."""
        with self._lock:
            now = self._clock()
            return [a for a, s in self._slots.items() if s.unhealthy_until > now]

    def all_unhealthy(self) -> bool:
        with self._lock:
            now = self._clock()
            return bool(self._slots) and all(s.unhealthy_until > now for s in self._slots.values())

    def update(self, addresses: Sequence[str]) -> list[E]:
        """Use exactly `addresses`; return the endpoints to close now.

        Endpoints of addresses that remain are kept with their health; new addresses get new
        endpoints. A removed endpoint is returned here when idle, else by `release()` when its
        last call ends.
        """
        with self._lock:
            slots = {a: self._slots.pop(a, None) or _Slot(self._open(a)) for a in addresses}
            gone, self._slots = list(self._slots.values()), slots
            self._retired.extend(s for s in gone if s.in_flight)
            return [s.endpoint for s in gone if not s.in_flight]

    def pick(self, after: E | None = None, *, hold: bool = True) -> E:
        """The endpoint for a new call (`after` None) or for the retry of one that used `after`.

        `hold`: count the call until `release()` (streams are not counted).
        """
        with self._lock:
            slots = list(self._slots.values())
            if not slots:
                raise BatchgateError(grpc.StatusCode.UNAVAILABLE, "no server address to call")
            now = self._clock()
            position = next((i for i, s in enumerate(slots) if s.endpoint is after), None)
            if position is None:
                healthy = [s for s in slots if s.unhealthy_until <= now]
                slot = healthy[next(self._turn) % len(healthy)] if healthy else None
                ring = slots
            else:
                ring = slots[position + 1 :] + slots[: position + 1]
                slot = next((s for s in ring if s.unhealthy_until <= now), None)
            if slot is None:
                slot = min(ring, key=lambda s: s.unhealthy_until)
            if hold:
                slot.in_flight += 1
            return slot.endpoint

    def release(self, endpoint: E, code: grpc.StatusCode | None) -> bool:
        """End a held call on `endpoint`: `code` None for success, else its error code.

        True: the endpoint was removed by `update()` and is now idle; the caller closes it.
        """
        with self._lock:
            slot = next(
                (s for s in [*self._slots.values(), *self._retired] if s.endpoint is endpoint),
                None,
            )
            if slot is None:
                return False
            slot.in_flight -= 1
            if code is None:
                slot.failures, slot.unhealthy_until = 0, -math.inf
            elif code is grpc.StatusCode.UNAVAILABLE and self._unhealthy_for_s > 0:
                slot.failures += 1
                cool_down_s = self._unhealthy_for_s * 2 ** min(slot.failures - 1, 16)
                slot.unhealthy_until = self._clock() + min(MAX_UNHEALTHY_FOR_S, cool_down_s)
            if slot in self._retired and not slot.in_flight:
                self._retired.remove(slot)
                return True
            return False

    def take_all(self) -> list[E]:
        """Empty the pool; return every endpoint, removed ones included, to close."""
        with self._lock:
            slots = [*self._slots.values(), *self._retired]
            self._slots, self._retired = {}, []
            return [s.endpoint for s in slots]
