"""The words of every refusal both front ends send, written once: the request checks'
(``server/frontend/codec.py``, ``server/native/src/request_checks.cc``), the token checks'
(``server/frontend/auth.py``, ``auth.cc``) and the fixed texts they share.

A message with parts that vary is a ``Template`` with named fields (``str.format`` syntax, no
format specs). Python renders it with ``TEMPLATE(field=value, ...)``; the native build turns
each one into a C++ function of the same fields, in the order they first appear
(``server/native/generate_rules.py`` writes ``rules.h`` from this module at build time), so
the two front ends cannot word the same mistake differently. Callers hand every field over as
text already rendered (numbers as ``str()``/``std::to_string`` write them, names quoted where a
template does not put quotes around them). ``tests/test_one_definition.py`` fails when a
template's words are written anywhere else.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Template:
    text: str

    def __call__(self, **fields: Any) -> str:
        return self.text.format(**fields)

    def pieces(self) -> Iterator[tuple[str, str | None]]:
        """``(literal text, the field after it or None)``, in order."""
        for literal, field, spec, conversion in string.Formatter().parse(self.text):
            if spec or conversion:
                raise ValueError(f"a template field takes no format spec: {self.text!r}")
            yield literal, field

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields in the order they first appear."""
        seen: dict[str, None] = {}
        for _, field in self.pieces():
            if field is not None:
                seen.setdefault(field, None)
        return tuple(seen)


# -- fixed texts ---------------------------------------------------------------------------------

INTERNAL = Template("internal server error; the server log has the details")
SHARED_MEMORY_OFF = Template(
    "shared-memory tensors are off on this server (start it with --shared-memory to turn them "
    "on); send tensor data in raw_input_contents")
# A status message travels percent-encoded in a trailer (up to 3 bytes per byte): cut to this
# many bytes of UTF-8, it stays well under the 8 KiB clients accept.
MAX_MESSAGE_BYTES = 1024
MESSAGE_CUT = Template(" ... (message cut)")
# Dimensions of a shape quoted in a message; the rest is summarised (SHAPE_CUT).
SHOWN_DIMENSIONS = 8
SHAPE_CUT = Template("[{shown}, ...] ({dimensions} dimensions)")

# A request limit's refusal (server/rules/request_limits.py RULES): the rule's words, the flag that
# sets the limit and its value.
LIMIT_REFUSAL = Template("{refused} ({flag} {most})")

# -- a request's parameters ----------------------------------------------------------------------

PARAMETER_NOT_INTEGER = Template("request parameter '{key}' must be an integer, got {kind}")
PARAMETER_NEGATIVE = Template("request parameter '{key}' must be >= 0, got {value}")

# A tensor's shared_memory_* parameters; {tensor} is "input" or "output", {name} quoted.
PLACEMENT_INCOMPLETE = Template(
    "model '{model}': {tensor} {name}: the parameters 'shared_memory_region' and "
    "'shared_memory_byte_size' go together ('shared_memory_offset' is optional)")
PLACEMENT_REGION_NOT_STRING = Template(
    "model '{model}': {tensor} {name}: parameter 'shared_memory_region' must be a string, got "
    "{kind}")
PLACEMENT_NOT_INTEGER = Template(
    "model '{model}': {tensor} {name}: parameter '{key}' must be an integer, got {kind}")
PLACEMENT_NEGATIVE = Template(
    "model '{model}': {tensor} {name}: parameter '{key}' must be >= 0, got {value}")

# -- a request's inputs --------------------------------------------------------------------------

RAW_COUNT = Template("model '{model}': {raw} raw_input_contents for {inputs} inputs; {advice}")
RAW_COUNT_ADVICE = Template("send one raw buffer per input, in the order of 'inputs'")
RAW_COUNT_ADVICE_PLACED = Template(
    "send one raw buffer per input that is not in shared memory, in the order of 'inputs'")
NO_SUCH_INPUT = Template("model '{model}' has no input '{input}'; its inputs are {inputs}")
INPUT_TWICE = Template("model '{model}': input '{input}' is given twice")
BYTES_NOT_DECLARED = Template(
    "model '{model}': input '{input}' is {datatype}; BYTES tensors are accepted only by models "
    "that declare them (TYPE_STRING)")
WRONG_DATATYPE = Template("model '{model}': input '{input}' must be {datatype}, got {sent}")
BATCH_DISAGREES = Template(
    "model '{model}': inputs disagree on the batch dimension ({first} and {rows} for "
    "'{input}')")
MISSING_INPUTS = Template("model '{model}': missing inputs {inputs}")

# Shapes ({shape} as a list, cut to SHOWN_DIMENSIONS where the template says "shape text").
SHAPE_MISMATCH = Template(
    "model '{model}': input '{input}' must have shape [{expected}] (-1: any), got {shape}")
NEGATIVE_DIMENSION = Template(
    "model '{model}': input '{input}' has a negative dimension, got shape {shape}")
TOO_MANY_ELEMENTS = Template(
    "model '{model}': input '{input}' of shape {shape} has more elements than this server "
    "allows (--max-tensor-elements {most})")
BATCH_SIZE_RANGE = Template(
    "model '{model}': batch size must lie in 1..{max_batch_size} (the model's "
    "max_batch_size), got {rows} for input '{input}'")
TOO_MANY_BYTES = Template(
    "model '{model}': the request's inputs take more bytes than this server allows "
    "(--max-request-bytes {most})")

# Where an input's values are.
PLACED_WITH_CONTENTS = Template(
    "model '{model}': input {name} is in shared memory and has contents too; use one or the "
    "other")
PLACED_SIZE = Template(
    "model '{model}': input {name} of shape {shape} and datatype {datatype} needs {expected} "
    "bytes, shared_memory_byte_size is {nbytes}")
RAW_WITH_CONTENTS = Template(
    "model '{model}': input '{input}' has typed contents while the request uses "
    "raw_input_contents; use one or the other")
RAW_SIZE = Template(
    "model '{model}': input '{input}' of shape {shape} and datatype {datatype} needs "
    "{expected} bytes, got {sent}")
BOOL_NOT_0_OR_1 = Template("model '{model}': BOOL input '{input}' must hold bytes 0 and 1 only")
BYTES_NOT_ENCODED = Template(
    "model '{model}': BYTES input '{input}' must hold {count} elements, each a 4-byte "
    "little-endian length followed by that many bytes")
BYTES_CONTENTS_COUNT = Template(
    "model '{model}': input '{input}' of shape {shape} needs {count} bytes_contents, got {sent}")
NO_TYPED_CONTENTS = Template(
    "model '{model}': input '{input}' is {datatype}, which has no typed contents field; send "
    "it in raw_input_contents")
CONTENTS_COUNT = Template(
    "model '{model}': input '{input}' of shape {shape} needs {count} values in "
    "contents.{field}, got {sent}")
CONTENTS_OUT_OF_RANGE = Template(
    "model '{model}': input '{input}' has values outside the range of {datatype}")

# -- a request's outputs and its reply -----------------------------------------------------------

NO_SUCH_OUTPUT = Template("model '{model}' has no output '{output}'; its outputs are {outputs}")
OUTPUT_TWICE = Template("model '{model}': output '{output}' is requested twice")
REPLY_TOO_LARGE = Template(
    "model '{model}': the reply would take {size} bytes, more than this server sends "
    "(--max-message-bytes {most})")

# -- the model a request names (server/executor/repository.py, model_table.cc) -------------------

# ``model`` and ``version`` quoted by the caller (``quoted``, ``Quoted``): a client's name may
# hold anything.
MODEL_UNKNOWN = Template("unknown model {model}")
MODEL_NOT_AVAILABLE = Template("model {model} is not available: {reason}")
MODEL_NO_VERSION = Template(
    "model {model} has no version {version} being served (serving version {serving})")

# -- the server's own state and the RPCs it does not serve ----------------------------------------

SHUTTING_DOWN = Template("the server is shutting down; retry on another replica")
TRACING_UNSUPPORTED = Template("tracing is not supported by this server")
LOG_SETTINGS_FIXED = Template("log settings are fixed at start-up (--log-level, --log-format)")

# -- starting to serve (server/frontend/app.py, tls.py, server/supervisor/posix.py; frontend.cc,
# main.cc, handover.cc) ---------------------------------------------------------------------------

BIND_FAILED = Template("could not bind the gRPC port {address}")
# ``detail``: what gRPC said, where it says it (" (...)"), else "".
TLS_BIND_FAILED = Template(
    "could not serve TLS on {address}: if the port is free, the certificate or key is the cause "
    "(--tls-cert, --tls-key: a certificate chain and its own private key, PEM); gRPC's log "
    "lines above say which{detail}")
TLS_CLIENT_CA_NEEDS = Template("needs tls_cert and tls_key")
SCHEDULING_NOT_APPLIED_EFFECT = Template("the request path may preempt model threads under load")
CPUS_NOT_APPLIED_EFFECT = Template("model threads and the request path share every CPU")

# -- bearer tokens (server/frontend/auth.py) --------------------------------------------------------------

TOKEN_MISSING = Template(
    "{method} needs {which}: send the metadata 'authorization: Bearer <token>'")
TOKEN_MISSING_WHICH = Template("a bearer token")
TOKEN_MISSING_WHICH_ADMIN = Template("the admin token")
TOKEN_WRONG = Template("the bearer token sent is not valid for {method}{admin}")
TOKEN_WRONG_ADMIN = Template(" (an admin RPC: it needs the admin token)")


def templates() -> dict[str, Template]:
    """Every template here, by its name."""
    return {name: value for name, value in globals().items() if isinstance(value, Template)}
