"""How a setting is declared, and how a flag's text becomes its value.

``setting()`` declares a ``Settings`` field with its flag, help and roles; the parsers here turn
a flag's text into the value (a CPU list, optional seconds or ports); ``RETIRED_FLAGS`` and
``RETIRED_FRONTENDS`` name what replaced a flag that served once, so that the CLI refuses it
saying what to pass. Importable without torch or grpc, like the settings.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any


def setting(default: Any = dataclasses.MISSING, *, help: str, roles: Iterable[str],
            flag: str | None = "", parse: Callable[[str], Any] | None = None,
            action: str | None = None, choices: Iterable[str] | None = None,
            default_text: str | None = None, env: str | None = None,
            repr: bool = True) -> Any:
    """A ``Settings`` field: its ``help`` (one line, what it does, with units in its name),
    the ``roles`` of the processes that act on it, and its command-line flag (``""``: from the
    field's name; ``None``: none). ``parse`` turns the flag's text into the value; ``action``
    is argparse's for a boolean switch; ``env`` names an environment variable that supplies
    the default; ``default_text`` says the default in ``--help`` where the value would not."""
    metadata = {"help": help, "roles": frozenset(roles), "flag": flag, "parse": parse,
                "action": action, "choices": tuple(choices) if choices else None,
                "default_text": default_text, "env": env}
    factory = dataclasses.MISSING
    if env is not None:
        fallback = default

        def factory() -> Any:
            text = os.environ.get(env)
            return fallback if text is None else (parse or str)(text)
        default = dataclasses.MISSING
    return dataclasses.field(default=default, default_factory=factory, metadata=metadata,
                             repr=repr)


def optional_seconds(text: str) -> float | None:
    """Seconds, or -1 (any negative value) for none."""
    value = float(text)
    return None if value < 0 else value


def optional_port(text: str) -> int | None:
    value = int(text)
    return None if value < 0 else value


# Flags that served once and are gone, with what replaces them: the CLI refuses each with its
# text, so that a deployment upgraded with its old command line fails at start, saying what to
# pass, instead of serving in a mode nobody chose.
RETIRED_FLAGS = {
    "--frontends": (
        "--frontends was removed with the Python front-end processes: more than one process "
        "serves through the native front end (--frontend native; one process using every "
        "core, --frontend-threads sizes it), and --frontend single replaces --frontends 0"),
}
RETIRED_FRONTENDS = {
    "python": (
        "--frontend python (Python front-end processes) was removed: use --frontend native "
        "(the C++ front end, built by make native) or --frontend single (one Python process, "
        "for debugging)"),
}


def frontend_mode(text: str) -> str:
    if text in RETIRED_FRONTENDS:
        raise ValueError(f"{RETIRED_FRONTENDS[text]}, got --frontend {text}")
    return text


def cpu_list(text: str) -> tuple[int, ...]:
    """A CPU list as ``taskset -c`` and ``/proc/<pid>/status`` write it ("1", "2-7,9"): the
    CPUs, sorted, each once."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last) if last else int(first)
            if low < 0 or high < low:
                raise ValueError
            cpus.update(range(low, high + 1))
    except ValueError:
        raise ValueError(f"model_cpus must be a CPU list such as 1 or 2-7,9, got {text!r}"
                         ) from None
    return tuple(sorted(cpus))


def usable_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on, where the system says (Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


def cpus_text(cpus: Iterable[int]) -> str:
    """CPUs as a list in ranges ("0-3,6"), the way ``cpu_list`` reads them."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
