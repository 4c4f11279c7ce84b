"""A ModelInferRequest's wire bytes counted against ``server/rules/request_limits.py``'s rules before
they are parsed: ``scan_infer_request(data, limits)``.

The scan walks the protobuf wire format (tags, varints, lengths) and allocates nothing per
field: a length-delimited field it need not look into is skipped in O(1), a packed shape's
dimensions are counted a window at a time (the bytes that end a varint, deleted in C and
counted), and every count stops the scan as soon as it passes its bound. It looks into the
messages a count lives in (the inputs, their shapes, parameters and contents; the outputs and
their parameters) and reads nothing it does not count.

Bytes that are not a protobuf message (a varint or a length cut short, a length past the end
of its message, a field number 0, a wire type 6 or 7, a group that does not end, nesting past
protobuf's depth of 100, a length or tag in more than five bytes) raise ``MalformedRequest``,
which the caller answers as the parser's error; so does anything the parser would refuse in
what the scan reads, except UTF-8 in strings, which the parse after it checks.
``server/native/src/wire_scan.cc`` is the same scan in C++: the two count in the same order
and refuse the same request with the same rule.
"""

from __future__ import annotations

import re
from typing import Any

from batchgate.batcher.errors import ResourceExhausted
from batchgate.server.rules import request_limits
from batchgate.server.rules.request_limits import RULES

MAX_DEPTH = 100  # protobuf's recursion limit, in C++ and in upb
_LOW_BYTES = bytes(range(0x80))  # the bytes that end a varint
_WINDOW = 1 << 16
# InferTensorContents' numeric fields unpacked (one value a field): bool, int, int64, uint,
# uint64 as varints (at most ten bytes), fp32 as four bytes, fp64 as eight; a run of them, any
# mixed, matched possessively (no backtracking, nothing kept per value).
_UNPACKED_TAGS = frozenset({0x08, 0x10, 0x18, 0x20, 0x28, 0x35, 0x39})
_UNPACKED_VALUES = re.compile(
    rb"(?:[\x08\x10\x18\x20\x28][\x80-\xff]{0,9}[\x00-\x7f]|\x35[\x00-\xff]{4}"
    rb"|\x39[\x00-\xff]{8})*+")
# The same run of one field's values only, by its tag.
_UNPACKED_RUNS = {
    tag: re.compile((re.escape(bytes([tag])) + (rb"[\x00-\xff]{4}" if tag == 0x35 else
                                                  rb"[\x00-\xff]{8}" if tag == 0x39 else
                                                  rb"[\x80-\xff]{0,9}[\x00-\x7f]")).join(
        (rb"(?:", rb")*+")))
    for tag in _UNPACKED_TAGS}
# What one value of InferTensorContents' numeric fields (1-7) takes parsed, by field number:
# bool 1 byte; int, uint, fp32 4; int64, uint64, fp64 8.
_PARSED_WIDTH = (0, 1, 4, 8, 4, 8, 4, 8)
# A run of values that mixes fields counts this many bytes parsed per byte sent: the most any
# value can take (8 bytes for 2 sent).
_MIXED_RUN_FACTOR = 4


class MalformedRequest(Exception):
    """The bytes are not a ModelInferRequest: the parser would refuse them too."""


class WireLimits:
    """Each rule's bound (``request_limits.RULES``), by the rule's key."""

    __slots__ = ("inputs", "raw_input_contents", "outputs", "parameters", "dimensions",
                 "bytes_contents", "name_bytes", "unknown_fields", "contents_bytes",
                 "_refusals")

    def __init__(self, bounds: dict[str, int]) -> None:
        for rule in RULES:
            setattr(self, rule.key, bounds[rule.key])
        self._refusals = {rule.key: rule.refusal(bounds[rule.key]) for rule in RULES}

    @classmethod
    def of(cls, settings: Any) -> WireLimits:
        """The bounds ``settings`` (the settings' fields, by name) set."""
        return cls(request_limits.bounds_of(settings))

    def refusal(self, key: str) -> ResourceExhausted:
        return ResourceExhausted(self._refusals[key])


DEFAULT_WIRE_LIMITS = WireLimits(request_limits.bounds(request_limits.defaults()))


def scan_infer_request(data: bytes, limits: WireLimits = DEFAULT_WIRE_LIMITS) -> None:
    """Returns when ``data`` holds no more than ``limits`` allow; ResourceExhausted naming the
    first rule it passes (in wire order), or MalformedRequest."""
    _Scan(data, limits).request()


def _varint(data: bytes, pos: int, end: int, most_bytes: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; MalformedRequest when it is cut short
    by ``end`` or runs past ``most_bytes``."""
    value = 0
    shift = 0
    stop = min(end, pos + most_bytes)
    while pos < stop:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise MalformedRequest


def _tag(data: bytes, pos: int, end: int) -> tuple[int, int]:
    byte = data[pos]
    if 8 <= byte < 0x80:
        return byte, pos + 1
    tag, pos = _varint(data, pos, end, 5)
    if tag < 8 or tag > 0xFFFFFFFF:  # field number 0; more than 32 bits
        raise MalformedRequest
    return tag, pos


def _length(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """A length-delimited field's length and where its bytes start, which must end by ``end``
    (as the C++ parser reads a size: at most five bytes, under 2**31)."""
    if pos < end and data[pos] < 0x80:
        length = data[pos]
        pos += 1
    else:
        length, pos = _varint(data, pos, end, 5)
        if length >= 1 << 31:
            raise MalformedRequest
    if pos + length > end:
        raise MalformedRequest
    return length, pos


def _low_bytes(data: bytes, pos: int, end: int) -> int:
    """How many bytes of ``data[pos:end]`` are under 0x80, counted a window at a time."""
    count = 0
    while pos < end:
        window = data[pos:min(end, pos + _WINDOW)]
        count += len(window) - len(window.translate(None, _LOW_BYTES))
        pos += _WINDOW
    return count


def _varint_count(data: bytes, pos: int, end: int, room: int) -> int:
    """How many varints the packed field ``data[pos:end]`` holds (the bytes that end one),
    counted a window at a time and given up as soon as the count passes ``room``."""
    count = 0
    while pos < end:
        window = data[pos:min(end, pos + _WINDOW)]
        count += len(window) - len(window.translate(None, _LOW_BYTES))
        if count > room:
            break
        pos += _WINDOW
    return count


def _run_bytes(data: bytes, tag: int, start: int, end: int) -> int:
    """What the run of unpacked values ``data[start:end]``, starting with ``tag``, takes parsed:
    exact when they are all of ``tag``'s field (a second match in C tells), else
    _MIXED_RUN_FACTOR per byte."""
    if _UNPACKED_RUNS[tag].match(data, start, end).end() != end:
        return _MIXED_RUN_FACTOR * (end - start)
    width = _PARSED_WIDTH[tag >> 3]
    if tag == 0x35:
        return (end - start) // 5 * width
    if tag == 0x39:
        return (end - start) // 9 * width
    # A varint value: its tag and its last byte are under 0x80, the bytes between are not.
    return _low_bytes(data, start, end) // 2 * width


class _Scan:
    __slots__ = ("data", "limits", "strings", "unknown", "contents_bytes")

    def __init__(self, data: bytes, limits: WireLimits) -> None:
        self.data = data
        self.limits = limits
        self.strings = self.unknown = 0  # the counts across the request's messages
        self.contents_bytes = 0

    # -- the messages ----------------------------------------------------------------------------

    def request(self) -> None:
        data, limits = self.data, self.limits
        most_raw, most_inputs, most_outputs = (limits.raw_input_contents, limits.inputs,
                                               limits.outputs)
        end = len(data)
        pos = raw = inputs = outputs = parameters = 0
        while pos < end:
            tag = data[pos]
            if 8 <= tag < 0x80:
                pos += 1
            else:
                tag, pos = _tag(data, pos, end)
            if tag & 7 != 2:
                pos = self.other(tag, pos, end, 0)
                continue
            if pos < end and data[pos] < 0x80:
                length = data[pos]
                pos += 1
            else:
                length, pos = _length(data, pos, end)
            stop = pos + length
            if stop > end:
                raise MalformedRequest
            if tag == 0x3A:  # raw_input_contents
                raw += 1
                if raw > most_raw:
                    raise limits.refusal("raw_input_contents")
            elif tag == 0x2A:  # inputs
                inputs += 1
                if inputs > most_inputs:
                    raise limits.refusal("inputs")
                self.tensor(pos, stop)
            elif tag == 0x32:  # outputs
                outputs += 1
                if outputs > most_outputs:
                    raise limits.refusal("outputs")
                self.output(pos, stop)
            elif tag <= 0x1A:  # model_name, model_version, id
                if length > limits.name_bytes:
                    raise limits.refusal("name_bytes")
            elif tag == 0x22:  # parameters
                parameters += 1
                if parameters > limits.parameters:
                    raise limits.refusal("parameters")
                self.entry(pos, stop, 1)
            else:
                self.count_unknown()
            pos = stop

    def tensor(self, pos: int, end: int) -> None:
        """An InferInputTensor (level 1)."""
        data, limits = self.data, self.limits
        dimensions = parameters = 0
        while pos < end:
            tag = data[pos]
            if 8 <= tag < 0x80:
                pos += 1
            else:
                tag, pos = _tag(data, pos, end)
            if tag & 7 != 2:
                if tag == 0x18:  # shape, one unpacked dimension
                    dimensions += 1
                    if dimensions > limits.dimensions:
                        raise limits.refusal("dimensions")
                    _, pos = _varint(data, pos, end, 10)
                else:
                    pos = self.other(tag, pos, end, 1)
                continue
            if pos < end and data[pos] < 0x80:
                length = data[pos]
                pos += 1
            else:
                length, pos = _length(data, pos, end)
            stop = pos + length
            if stop > end:
                raise MalformedRequest
            if tag <= 0x12:  # name, datatype
                if length > limits.name_bytes:
                    raise limits.refusal("name_bytes")
            elif tag == 0x1A:  # shape, packed
                room = limits.dimensions - dimensions
                if length <= room:  # each dimension takes a byte at least
                    dimensions += length - len(data[pos:stop].translate(None, _LOW_BYTES))
                else:
                    dimensions += _varint_count(data, pos, stop, room)
                    if dimensions > limits.dimensions:
                        raise limits.refusal("dimensions")
            elif tag == 0x22:  # parameters
                parameters += 1
                if parameters > limits.parameters:
                    raise limits.refusal("parameters")
                self.entry(pos, stop, 2)
            elif tag == 0x2A:  # contents
                self.contents(pos, stop)
            else:
                self.count_unknown()
            pos = stop

    def contents(self, pos: int, end: int) -> None:
        """An InferTensorContents (level 2): its bytes_contents counted, and its numeric
        values' bytes as parsed (``contents_bytes``); the rest skipped."""
        data, limits = self.data, self.limits
        while pos < end:
            tag = data[pos]
            if 8 <= tag < 0x80:
                pos += 1
            else:
                tag, pos = _tag(data, pos, end)
            field = tag >> 3
            wire_type = tag & 7
            if wire_type == 2:
                length, pos = _length(data, pos, end)
                if field == 8:
                    self.strings += 1
                    if self.strings > limits.bytes_contents:
                        raise limits.refusal("bytes_contents")
                elif field > 8:
                    self.count_unknown()
                else:  # 1-7 packed: values of their own type
                    width = _PARSED_WIDTH[field]
                    if field >= 6:
                        values = length // width
                    else:
                        room = (limits.contents_bytes - self.contents_bytes) // width
                        values = _varint_count(data, pos, pos + length, room)
                    self.add_contents(values * width)
                pos += length
            elif tag in _UNPACKED_TAGS and data[pos - 1] == tag:
                # Values sent one field each (not packed): the run of them is matched in C,
                # at ~40 ns a value where a loop here would take ~10 times as long.
                start = pos - 1
                run_end = _UNPACKED_VALUES.match(data, start, end).end()
                if run_end < pos:  # not even one: a value cut short
                    raise MalformedRequest
                self.add_contents(_run_bytes(data, tag, start, run_end))
                pos = run_end
            elif wire_type == 0 and field <= 5:
                _, pos = _varint(data, pos, end, 10)
                self.add_contents(_PARSED_WIDTH[field])
            elif (wire_type == 5 and field == 6) or (wire_type == 1 and field == 7):
                pos += 4 if wire_type == 5 else 8
                if pos > end:
                    raise MalformedRequest
                self.add_contents(_PARSED_WIDTH[field])
            else:
                pos = self.other(tag, pos, end, 2)

    def add_contents(self, parsed: int) -> None:
        self.contents_bytes += parsed
        if self.contents_bytes > self.limits.contents_bytes:
            raise self.limits.refusal("contents_bytes")

    def output(self, pos: int, end: int) -> None:
        """An InferRequestedOutputTensor (level 1)."""
        data, limits = self.data, self.limits
        parameters = 0
        while pos < end:
            tag = data[pos]
            if 8 <= tag < 0x80:
                pos += 1
            else:
                tag, pos = _tag(data, pos, end)
            if tag & 7 != 2:
                pos = self.other(tag, pos, end, 1)
                continue
            if pos < end and data[pos] < 0x80:
                length = data[pos]
                pos += 1
            else:
                length, pos = _length(data, pos, end)
            stop = pos + length
            if stop > end:
                raise MalformedRequest
            if tag == 0x0A:  # name
                if length > limits.name_bytes:
                    raise limits.refusal("name_bytes")
            elif tag == 0x12:  # parameters
                parameters += 1
                if parameters > limits.parameters:
                    raise limits.refusal("parameters")
                self.entry(pos, stop, 2)
            else:
                self.count_unknown()
            pos = stop

    def entry(self, pos: int, end: int, level: int) -> None:
        """A parameters map's entry: key = 1 (a string), value = 2 (an InferParameter)."""
        data, limits = self.data, self.limits
        while pos < end:
            tag = data[pos]
            if 8 <= tag < 0x80:
                pos += 1
            else:
                tag, pos = _tag(data, pos, end)
            field = tag >> 3
            if tag & 7 != 2:
                pos = self.other(tag, pos, end, level)
                continue
            if pos < end and data[pos] < 0x80:
                length = data[pos]
                pos += 1
            else:
                length, pos = _length(data, pos, end)
            stop = pos + length
            if stop > end:
                raise MalformedRequest
            if field == 1:
                if length > limits.name_bytes:
                    raise limits.refusal("name_bytes")
            elif field == 2:
                self.parameter(pos, stop, level + 1)
            else:
                self.count_unknown()
            pos = stop

    def parameter(self, pos: int, end: int, level: int) -> None:
        """An InferParameter: bool = 1, int64 = 2, string = 3, double = 4, uint64 = 5."""
        data, limits = self.data, self.limits
        while pos < end:
            tag = data[pos]
            if 8 <= tag < 0x80:
                pos += 1
            else:
                tag, pos = _tag(data, pos, end)
            if tag == 0x1A:  # string_param
                length, pos = _length(data, pos, end)
                if length > limits.name_bytes:
                    raise limits.refusal("name_bytes")
                pos += length
            elif tag in (0x08, 0x10, 0x28):
                _, pos = _varint(data, pos, end, 10)
            elif tag == 0x21:
                pos += 8
                if pos > end:
                    raise MalformedRequest
            elif tag & 7 == 2:
                length, pos = _length(data, pos, end)
                self.count_unknown()
                pos += length
            else:
                pos = self.other(tag, pos, end, level)

    # -- what no rule names --------------------------------------------------------------------

    def count_unknown(self) -> None:
        self.unknown += 1
        if self.unknown > self.limits.unknown_fields:
            raise self.limits.refusal("unknown_fields")

    def other(self, tag: int, pos: int, end: int, level: int) -> int:
        """A field that is not length-delimited and that no rule counts: checked, counted as
        unknown and skipped; where it ends."""
        wire_type = tag & 7
        if wire_type > 5 or wire_type == 4:  # 6, 7: no such type; 4: a group ends, none began
            raise MalformedRequest
        self.count_unknown()
        if wire_type == 0:
            return _varint(self.data, pos, end, 10)[1]
        if wire_type == 3:
            return self.group(tag >> 3, pos, end, level + 1)
        pos += 8 if wire_type == 1 else 4
        if pos > end:
            raise MalformedRequest
        return pos

    def group(self, field: int, pos: int, end: int, level: int) -> int:
        """An unknown group's fields (each one unknown), up to its end; where that is."""
        if level > MAX_DEPTH:
            raise MalformedRequest
        data = self.data
        while pos < end:
            tag = data[pos]
            if 8 <= tag < 0x80:
                pos += 1
            else:
                tag, pos = _tag(data, pos, end)
            wire_type = tag & 7
            if wire_type == 4:
                if tag >> 3 != field:
                    raise MalformedRequest
                return pos
            if wire_type == 2:
                length, pos = _length(data, pos, end)
                self.count_unknown()
                pos += length
            else:
                pos = self.other(tag, pos, end, level)
        raise MalformedRequest
