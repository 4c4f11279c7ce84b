"""What one ModelInferRequest's wire bytes may hold, counted before the message is parsed.

Parsed, a repeated field costs far more than on the wire: an empty ``outputs`` entry is 2
bytes sent and an object of ~100 bytes in either front end, so a 64 MiB message could make
the server allocate gigabytes before any check ran. Each front end therefore scans a request's
bytes first (``server/request_scan.py`` here, ``server/native/src/wire_scan.cc`` in C++),
counting what the request asks for against these rules, and parses only what passes.

``RULES`` is the one definition of each rule: what is counted, the setting that bounds it
(``batchgate.server.settings``: its flag, default and help) and the refusal's words. The
supervisor hands the native front end every rule's bound and refusal as they are here
(``wire_limits``), so the two front ends refuse the same request with the same message.
Refusals are RESOURCE_EXHAUSTED, like the other limits: the server allows less, not the
protocol.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


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
        return f"{self.refused} ({self.flag} {most})"


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
)
RULE_KEYS = tuple(rule.key for rule in RULES)


def wire_limits(settings: Any) -> dict[str, list]:
    """Every rule's bound and refusal for ``settings`` (anything with the settings' fields),
    as the native front end's handover carries them: ``{key: [most, refusal]}``."""
    return {rule.key: [getattr(settings, rule.setting),
                       rule.refusal(getattr(settings, rule.setting))] for rule in RULES}


def defaults() -> dict[str, int]:
    """The rules' settings at their declared defaults."""
    from batchgate.server.settings import Settings

    wanted = {rule.setting for rule in RULES}
    return {f.name: f.default for f in dataclasses.fields(Settings) if f.name in wanted}


def bounds(values: Mapping[str, int]) -> dict[str, int]:
    """Each rule's bound from the settings' ``values`` (by setting name)."""
    return {rule.key: values[rule.setting] for rule in RULES}
