"""What one ModelInferRequest's wire bytes may hold, counted before the message is parsed.

Parsed, a repeated field costs far more than on the wire: an empty ``outputs`` entry is 2
bytes sent and an object of ~100 bytes in either front end, so a 64 MiB message could make
the server allocate gigabytes before any check ran. Each front end therefore scans a request's
bytes first (``server/frontend/request_scan.py`` here, ``server/native/src/wire_scan.cc`` in C++),
counting what the request asks for against these rules, and parses only what passes.

``RULES`` is the one definition of each rule: what is counted, the setting that bounds it
(``batchgate.server.config.settings``: its flag, default and help) and the refusal's words. The
supervisor hands the native front end every rule's bound and refusal as they are here
(``wire_limits``), so the two front ends refuse the same request with the same message.
Refusals are RESOURCE_EXHAUSTED, like the other limits: the server allows less, not the
protocol.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from batchgate.server.rules import messages


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    key: str
    """What is counted; the native front end knows each rule by it."""
    setting: str
    """The ``Settings`` field that bounds it (inclusive)."""
    refused: str
    """The refusal, before the flag and its value."""

    @property
    def flag(self) -> str:
        return "--" + self.setting.replace("_", "-")

    def refusal(self, most: int) -> str:
        return messages.LIMIT_REFUSAL(refused=self.refused, flag=self.flag, most=most)


RULES = (
    Rule("inputs", "max_request_inputs", "the request has more inputs than this server allows"),
    Rule("raw_input_contents", "max_request_inputs",
         "the request has more raw_input_contents than this server allows inputs"),
    Rule("outputs", "max_request_outputs",
         "the request asks for more outputs than this server allows"),
    Rule("parameters", "max_request_parameters",
         "a parameters map of the request has more entries than this server allows"),
    Rule("dimensions", "max_tensor_dimensions",
         "a tensor's shape in the request has more dimensions than this server allows"),
    Rule("bytes_contents", "max_request_string_elements",
         "the request has more contents.bytes_contents entries than this server allows; send "
         "BYTES tensors in raw_input_contents"),
    Rule("name_bytes", "max_request_name_bytes",
         "a name or string of the request (model name or version, id, a tensor's name or "
         "datatype, a parameter's key or string value) is longer than this server allows"),
    Rule("unknown_fields", "max_request_unknown_fields",
         "the request has more fields this server does not know than it allows"),
    # Parsed, a typed contents value takes its type's width (bool 1 byte; int, uint, fp32 4;
    # int64, uint64, fp64 8) however few bytes it took on the wire: a 1-byte int64 value costs
    # 8 bytes. Values sent one field each that mix fields in one run count 4 bytes parsed for
    # each byte sent (the most any value can cost: 8 for 2), as no valid tensor mixes them.
    Rule("contents_bytes", "max_request_bytes",
         "the request's typed contents take more bytes, parsed, than this server allows a "
         "request's inputs"),
)
RULE_KEYS = tuple(rule.key for rule in RULES)


def _value(values: Mapping[str, Any], setting: str) -> int:
    value = values[setting]
    if value is None and setting == "max_request_bytes":  # unset: --max-message-bytes
        value = values["max_message_bytes"]
    return value


def _values(settings: Any) -> dict[str, Any]:
    names = {rule.setting for rule in RULES} | {"max_message_bytes"}
    return {name: getattr(settings, name) for name in names}


def wire_limits(settings: Any) -> dict[str, list]:
    """Every rule's bound and refusal for ``settings`` (anything with the settings' fields),
    as the native front end's handover carries them: ``{key: [most, refusal]}``."""
    return {key: [most, rule.refusal(most)]
            for rule, (key, most) in zip(RULES, bounds(_values(settings)).items())}


def defaults() -> dict[str, int]:
    """The rules' settings at their declared defaults."""
    from batchgate.server.config.settings import Settings

    wanted = {rule.setting for rule in RULES} | {"max_message_bytes"}
    return {f.name: f.default for f in dataclasses.fields(Settings) if f.name in wanted}


def bounds(values: Mapping[str, Any]) -> dict[str, int]:
    """Each rule's bound from the settings' ``values`` (by setting name)."""
    return {rule.key: _value(values, rule.setting) for rule in RULES}


def bounds_of(settings: Any) -> dict[str, int]:
    """Each rule's bound for ``settings`` (anything with the settings' fields)."""
    return bounds(_values(settings))
