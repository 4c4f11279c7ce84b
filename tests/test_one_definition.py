"""Each rule both front ends apply is written once: its words and numbers appear in its one
definition (``server/rules/messages.py``, ``server/rules/request_limits.py``, ``protos/datatypes.py``,
``server/rules/rpc_access.py``, ``batcher/metric_families.py``, ``protos/wire.proto``) and nowhere
else in the C++ or Python sources; the native build generates its copy (``rules.h``) from them.

Sources are read as their string literals (Python through ``ast``, adjacent C++ literals joined
as the compiler joins them), so a second copy is found however its lines are broken. Tests are
not sources: they spell the messages out to check them."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from batchgate.batcher import metric_families
from batchgate.protos import datatypes, wire_pb2
from batchgate.server.rules import messages
from batchgate.server.rules import request_limits
from batchgate.server.rules import rpc_access

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "server" / "native"
DEFINITIONS = {ROOT / "server" / "rules" / "messages.py", ROOT / "server" / "rules" / "request_limits.py",
               ROOT / "protos" / "datatypes.py", ROOT / "server" / "rules" / "rpc_access.py",
               ROOT / "batcher" / "metric_families.py"}
# Words shorter than this are common English ("model '", " bytes, got "), not a rule's.
SHORTEST_PIECE = 12


def _python_sources() -> list[Path]:
    files = []
    # The server's: the SDK and the benchmarks read metric names and messages, as clients do.
    for folder in ("server", "batcher", "protos"):
        files += [p for p in (ROOT / folder).rglob("*.py")
                  if p not in DEFINITIONS and not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    return files


def _cpp_sources() -> list[Path]:
    return sorted(p for p in (NATIVE / "src").iterdir() if p.suffix in (".cc", ".h"))


def _python_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


_CPP_LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
_CPP_COMMENT = re.compile(r"//[^\n]*")


def _cpp_literals(path: Path) -> list[str]:
    text = _CPP_COMMENT.sub("", path.read_text())
    literals, end, current = [], None, None
    for match in _CPP_LITERAL.finditer(text):
        value = match.group(1).encode().decode("unicode_escape")
        if end is not None and not text[end:match.start()].strip():
            current += value  # "a" "b": one literal
        else:
            if current is not None:
                literals.append(current)
            current = value
        end = match.end()
    if current is not None:
        literals.append(current)
    return literals


@pytest.fixture(scope="module")
def literals() -> dict[Path, list[str]]:
    found = {path: _python_literals(path) for path in _python_sources()}
    found.update({path: _cpp_literals(path) for path in _cpp_sources()})
    return found


def _defined_words() -> dict[str, str]:
    """Every rule's words (a template's literal pieces), by where they are defined."""
    words = {}
    for name, template in messages.templates().items():
        for literal, _ in template.pieces():
            if len(literal.strip()) >= SHORTEST_PIECE:
                words[literal.strip()] = f"server/rules/messages.py {name}"
    for rule in request_limits.RULES:
        words[rule.refused] = f"server/rules/request_limits.py {rule.key}"
    for family in metric_families.NATIVE_FAMILIES:
        words[family.help] = f"batcher/metric_families.py {family.name}"
        words[family.name] = f"batcher/metric_families.py {family.name}"
    for field, _ in datatypes.CONTENTS_FIELDS.values():
        words[field] = "protos/datatypes.py CONTENTS_FIELDS"
    return words


def test_every_rules_words_are_written_once(literals):
    copies = [f"{path.relative_to(ROOT)}: {words!r} (defined in {where})"
              for words, where in _defined_words().items()
              for path, found in literals.items()
              if any(words in literal for literal in found)]
    assert not copies, "written again outside its definition:\n" + "\n".join(copies)


# A C++ literal this long with a space in it is prose a person reads (a message, a log line's
# words), not a name or a key: if Python writes the same words, one of them is a second copy.
_PROSE_CHARS = 20


def _prose(literal: str) -> list[str]:
    return [piece.strip() for piece in literal.split("%s")
            if len(piece.strip()) >= _PROSE_CHARS and " " in piece.strip()]


def test_no_prose_is_written_in_both_languages(literals):
    python = [literal for path, found in literals.items() if path.suffix == ".py"
              for literal in found]
    python += [literal for path in sorted(DEFINITIONS) for literal in _python_literals(path)]
    copies = sorted({f"{path.relative_to(ROOT)}: {piece!r}"
                     for path, found in literals.items() if path.suffix in (".cc", ".h")
                     for literal in found for piece in _prose(literal)
                     if any(piece in other for other in python)})
    assert not copies, ("written in C++ and in Python (define it once in "
                        "server/rules/messages.py):\n" + "\n".join(copies))


def test_the_check_is_not_blind(literals):
    # Each kind of source is read: a Python message and a C++ message of the front ends'
    # own (not rules) are found, split over lines as they are.
    assert any("the executor process is not connected; retry" in literal
               for literal in literals[NATIVE / "src" / "model_table.cc"])
    assert any("is not a serialized batchgate.handover.FrontendHandover" in literal
               for literal in literals[NATIVE / "src" / "handover.cc"])
    assert any("the buffer is not a BYTES tensor of shape" in literal
               for literal in literals[ROOT / "server" / "frontend" / "codec.py"])


def test_token_guarded_methods_are_named_once(literals):
    methods = rpc_access.ADMIN_METHODS | rpc_access.OPEN_METHODS
    for path in (ROOT / "server" / "frontend" / "auth.py", NATIVE / "src" / "auth.cc"):
        assert not methods & set(literals[path]), path
        assert rpc_access.METADATA_KEY not in literals[path], path


def test_datatypes_are_tabled_once(literals):
    names = set(datatypes.NUMPY_DTYPES)
    for path in (NATIVE / "src" / "model_table.cc", NATIVE / "src" / "request_checks.cc"):
        assert not (names - {"BYTES"}) & set(literals[path]), path


# The numbers: the frame limit (wire.proto) and the request limits' defaults (settings.py).
_SIXTY_FOUR_MIB = 64 << 20


def _python_numbers(path: Path) -> set[int]:
    numbers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.BinOp | ast.Constant):
            try:
                value = eval(compile(ast.Expression(node), str(path), "eval"), {})  # noqa: S307
            except Exception:  # noqa: BLE001 (names, calls: not a literal)
                continue
            if isinstance(value, int):
                numbers.add(value)
    return numbers


_CPP_NUMBER = re.compile(r"\b(\d+)(?:u|ul|ull|ll)?\b(?:\s*<<\s*(\d+))?", re.IGNORECASE)


def _cpp_numbers(path: Path) -> set[int]:
    text = _CPP_COMMENT.sub("", path.read_text())
    return {int(base) << int(shift or 0) for base, shift in _CPP_NUMBER.findall(text)}


def test_the_limits_are_written_once():
    assert wire_pb2.MAX_FRAME_BYTES == _SIXTY_FOUR_MIB  # what the scan below looks for
    from batchgate.server.config.settings import Settings

    defaults = {f.name: f.default for f in Settings.__dataclass_fields__.values()}
    assert defaults["max_message_bytes"] == defaults["max_tensor_elements"] == _SIXTY_FOUR_MIB
    # Every server module but the settings, where the defaults are declared.
    request_path = [path for path in _python_sources() + sorted(DEFINITIONS)
                    if path.parts[-3:] != ("server", "config", "settings.py")]
    copies = [str(path.relative_to(ROOT)) for path in request_path
              if _SIXTY_FOUR_MIB in _python_numbers(path)]
    copies += [str(path.relative_to(ROOT)) for path in _cpp_sources()
               if _SIXTY_FOUR_MIB in _cpp_numbers(path)]
    assert not copies, "64 MiB written again: " + ", ".join(copies)


def test_generated_header_holds_every_rule():
    spec = importlib.util.spec_from_file_location("generate_rules", NATIVE / "generate_rules.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    header = generator.generate()
    for name, template in messages.templates().items():
        if template.fields:
            assert f"inline std::string {generator.camel(name)}(" in header, name
        else:
            assert generator.cpp_string(template.text) in header, name
    for rule in request_limits.RULES:
        assert generator.cpp_string(rule.refused) in header
    for name in datatypes.NUMPY_DTYPES:
        size = datatypes.ELEMENT_SIZES.get(name, 0)
        assert f'{{"{name}", DataType::k{generator.camel(name)}, {size}, ' in header
    for method in rpc_access.ADMIN_METHODS | rpc_access.OPEN_METHODS:
        assert generator.cpp_string(method) in header
    for family in metric_families.NATIVE_FAMILIES:
        assert f"# HELP {family.exposed_name} {family.help}" in header
