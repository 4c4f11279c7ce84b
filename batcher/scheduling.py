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


def model_thread(name: str) -> None:
    """On a thread that runs a model: the policy the process started with, not the request
    path's, and ``name`` as the thread's name in ``/proc`` (``top -H``, ``perf``; at most 15
    bytes are kept)."""
    try:
        if _started_with is not None and os.sched_getscheduler(0) == os.SCHED_BATCH:
            os.sched_setscheduler(0, _started_with, os.sched_param(0))
    except OSError:  # allowed wherever the move to SCHED_BATCH was; nothing to do otherwise
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
