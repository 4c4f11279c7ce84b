"""The one error hierarchy of the serving path.

Everything below the transport raises one of these; ``server/frontend/errors.py`` maps each class to a
gRPC status code in a single table. Messages are written for the person who sent the request:
they say what was wrong and, where it helps, what was expected. Internal details (tracebacks,
exception reprs of a model) never go into a message that reaches a client.
"""

from __future__ import annotations


class BatchgateError(Exception):
    """Base of every error the serving path reports to a client."""


class ModelNotFound(BatchgateError):
    """Unknown model or version."""


class InvalidRequest(BatchgateError):
    """The request does not match the model: names, datatypes, shapes, sizes, parameters."""


class ModelUnavailable(BatchgateError):
    """The model is loading, unloading or failed; or the server is draining. Retryable."""


class QueueFull(BatchgateError):
    """The model's queue (or the priority level's) is at its ``max_queue_size``."""


class ResourceExhausted(BatchgateError):
    """A resource limit other than the queue (memory, message size) refused the work."""


class AdmissionRefused(ResourceExhausted):
    """The estimated queue wait already exceeds the request's deadline (``batcher/admission.py``)."""


class DeadlineExceeded(BatchgateError):
    """The request's timeout or gRPC deadline passed before it was answered."""


class DeadlineInfeasible(DeadlineExceeded):
    """The model's latency profile says the request cannot finish by its deadline even alone:
    refused at admission or dropped from the queue before it used the device."""


class RequestCancelled(BatchgateError):
    """The client went away; the request was removed from its queue."""


class ModelExecutionError(BatchgateError):
    """The model raised, or returned something that does not fit its configuration."""


class NotSupported(BatchgateError):
    """A feature of the protocol that this server does not provide."""


class LoadError(BatchgateError):
    """A model could not be loaded: bad configuration, missing artifact, failed warm-up."""


def quoted(text: str) -> str:
    """``text`` in single quotes for a message, as every front end writes it (the native one
    too, byte for byte): a backslash, a quote and the ASCII control characters are escaped
    (``\\\\``, ``\\'``, ``\\xNN``), everything else is kept as it is. Python's ``repr`` would
    switch quotes and escape by Unicode category, which another language cannot reproduce
    without Python's tables."""
    if text.isprintable() and "'" not in text and "\\" not in text:
        return f"'{text}'"  # the common case: nothing to escape
    parts = []
    for char in text:
        code = ord(char)
        if char == "\\" or char == "'":
            parts.append("\\" + char)
        elif code < 0x20 or code == 0x7F:
            parts.append(f"\\x{code:02x}")
        else:
            parts.append(char)
    return "'" + "".join(parts) + "'"


def quoted_list(names) -> str:
    """A list of names for a message: ``['a', 'b']``, each one ``quoted``."""
    return "[" + ", ".join(quoted(name) for name in names) + "]"



def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of the exception's message, cut at ``limit`` characters ("" for none)."""
    lines = str(exc).strip().splitlines()
    first = lines[0].strip() if lines else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


def exception_summary(exc: BaseException, limit: int = 200) -> str:
    """The exception's type and the first line of its message: enough to act on, no traceback
    (for a log line or a LoadError's message)."""
    first = first_line(exc, limit)
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
