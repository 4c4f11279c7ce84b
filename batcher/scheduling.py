"""Linux scheduling policies: the request path yields its core to model threads under load.

A thread under SCHED_BATCH does not preempt the running thread when it wakes: it waits for that
thread's time slice to end, or for an idle core. The request path (front ends, the executor's
event loop) wakes thousands of times a second under load; under SCHED_OTHER any of those
wake-ups may take the core from a model thread in the middle of a batch, which then waits its
turn while the device (or the core) it feeds idles. With the request path under SCHED_BATCH the
model threads keep their cores and the request path does its work in fewer, longer turns; on an
idle machine nothing changes (a woken thread takes an idle core at once). No privilege is
needed: a thread may move itself between SCHED_OTHER and SCHED_BATCH.

A serving process calls ``request_path()`` on its main thread before it starts other threads,
which inherit the policy; model threads call ``model_thread()``, which gives them back the
policy the process started with. No torch here: front-end processes import it too.
"""

from __future__ import annotations

import ctypes
import os

POLICIES = ("batch", "normal")

_PR_SET_NAME = 15
# The policy the process started with, once request_path() moved it to SCHED_BATCH; else None.
_started_with: int | None = None
# The CPUs model threads run on, once split_cpus() gave the request path the others; else None.
_model_cpus: frozenset[int] | None = None


def request_path(policy: str) -> str | None:
    """Put the calling thread, and the threads it starts from now on, under ``policy``:
    "batch" (SCHED_BATCH) or "normal" (as the process started). Only a thread under
    SCHED_OTHER moves: a policy someone chose for the whole process (``chrt``) stays.
    Returns why SCHED_BATCH could not be set (a sandbox that forbids it), else None."""
    global _started_with
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy != "batch":
        return None
    if not hasattr(os, "SCHED_BATCH"):
        return "this system has no SCHED_BATCH"
    try:
        if os.sched_getscheduler(0) == os.SCHED_OTHER:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            _started_with = os.SCHED_OTHER
    except OSError as exc:
        return f"sched_setscheduler: {exc.strerror}"
    return None


def split_cpus(model_cpus) -> str | None:
    """On a serving process's main thread, before it starts other threads: with
    ``model_cpus`` (``--model-cpus``; None: nothing changes) the calling thread, and the
    threads it starts from now on, run on the process's other CPUs, and model threads
    (``model_thread``) on those. Returns why that could not be done, else None."""
    global _model_cpus
    if model_cpus is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        return "this system sets no CPU affinity"
    try:
        usable = os.sched_getaffinity(0)
        request_cpus = usable - set(model_cpus)
        if not request_cpus or not set(model_cpus) <= usable:
            return (f"this process may run on CPUs {sorted(usable)} only, and the model "
                    f"CPUs are {sorted(model_cpus)}")
        os.sched_setaffinity(0, request_cpus)
    except OSError as exc:
        return f"sched_setaffinity: {exc.strerror}"
    _model_cpus = frozenset(model_cpus)
    return None


def model_cpus() -> frozenset[int] | None:
    """The CPUs model threads run on (``split_cpus``), or None where they run anywhere."""
    return _model_cpus


def model_thread(name: str) -> None:
    """On a thread that runs a model: the policy the process started with, not the request
    path's, the model CPUs where ``split_cpus`` set them, and ``name`` as the thread's name
    in ``/proc`` (``top -H``, ``perf``; at most 15 bytes are kept)."""
    try:
        if _started_with is not None and os.sched_getscheduler(0) == os.SCHED_BATCH:
            os.sched_setscheduler(0, _started_with, os.sched_param(0))
    except OSError:  # allowed wherever the move to SCHED_BATCH was; nothing to do otherwise
        pass
    if _model_cpus is not None:
        try:
            os.sched_setaffinity(0, _model_cpus)
        except OSError:  # allowed wherever split_cpus' own call was
            pass
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name is only a convenience
        pass


def current() -> str:
    """The calling thread's policy, as the setting names it ("batch", "normal", or the
    policy's number for any other)."""
    if not hasattr(os, "sched_getscheduler"):
        return "normal"
    policy = os.sched_getscheduler(0)
    if policy == os.SCHED_BATCH:
        return "batch"
    return "normal" if policy == os.SCHED_OTHER else str(policy)
