"""The tests' own helpers (tests/support): the poll helper, the ModelConfig writer and the
server harness's failure path. The harness's working path is every other server test."""

from __future__ import annotations

import ast
import asyncio
import itertools
from pathlib import Path

import pytest

from batchgate.protos import inference_pb2 as pb
from batchgate.bench.harness.server import ServerError, start_process
from batchgate.bench.harness.repository import (config_text, model_config, read_config, tensor,
                                                write_model)
from tests.support.polling import apoll, poll


def test_poll_returns_the_first_truthy_value_and_runs_the_step_between_tries():
    counter = itertools.count()
    steps = []
    assert poll(lambda: next(counter) >= 3 and "done", 10, step=lambda: steps.append(1)) == "done"
    assert len(steps) == 3


def test_poll_names_what_it_waited_for_when_the_deadline_passes():
    with pytest.raises(AssertionError, match="the thing: not reached within 0.01 s"):
        poll(lambda: False, 0.01, "the thing")


def test_apoll_awaits_its_step():
    async def main():
        seen = []

        async def step():
            seen.append(1)
            await asyncio.sleep(0)

        await apoll(lambda: len(seen) == 2, 10, step=step)
        with pytest.raises(AssertionError, match="never: not reached"):
            await apoll(lambda: False, 0.01, "never")
        return seen

    assert asyncio.run(main()) == [1, 1]


def test_write_model_writes_the_config_as_text_and_the_source_beside_it(tmp_path):
    config = model_config("m", max_batch_size=4, input=[tensor("X", "BYTES", [-1])],
                          output=[tensor("Y", "FP32", [2])], parameters={"k": 1})
    folder = write_model(tmp_path, config, "source", version=3)
    assert folder == tmp_path / "m"
    assert (folder / "3" / "model.py").read_text() == "source"
    assert read_config(folder) == config
    text = config_text(config)
    assert 'data_type: TYPE_STRING' in text and 'string_value: "1"' in text
    assert 'backend: "pytorch"' in text


def test_the_server_serves_the_configs_the_helper_wrote(stub, gate):
    """The test repository is written through write_model: the server reads back what the
    ModelConfig said, parameters and queue policy included."""
    config = stub.ModelConfig(pb.ModelConfigRequest(name="gated"), timeout=30).config
    assert config.max_batch_size == 8
    assert [t.name for t in config.input] == ["INPUT__0"]
    assert config.dynamic_batching.priority_levels == 2
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 16
    assert config.parameters["gate_dir"].string_value == str(gate.dir)


def test_a_server_that_cannot_start_raises_with_its_log(tmp_path):
    with pytest.raises(ServerError) as info:
        start_process(tmp_path / "absent", "single", timeout_s=120)
    message = str(info.value)
    assert "exited" in message and "log:" in message
    assert str(tmp_path / "absent") in message, message


def imported_test_modules(source: str) -> list[tuple[int, str]]:
    """The modules of this package (``tests...``) that ``source`` imports, with their lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            targets = ([f"tests.{a.name}" for a in node.names] if node.module == "tests"
                       else [node.module])
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, t) for t in targets if t == "tests" or t.startswith("tests.")]
    return found


def test_test_modules_take_their_helpers_from_tests_support_only():
    """Not from conftest (fixtures only) nor from one another."""
    assert imported_test_modules("from tests import conftest\nimport tests.test_sdk\n"
                                 "from tests.support.polling import poll") == [
        (1, "tests.conftest"), (2, "tests.test_sdk"), (3, "tests.support.polling")]
    offenders = [f"{path.name}:{line} {name}"
                 for path in sorted(Path(__file__).parent.glob("test_*.py"))
                 for line, name in imported_test_modules(path.read_text(encoding="utf-8"))
                 if name != "tests.support" and not name.startswith("tests.support.")]
    assert not offenders, offenders


def test_nothing_installed_imports_the_test_tree():
    """The package's folders (``batchgate.*``: benchmarks and gpu_check included) run where
    there is no ``tests/``: an installed ``batchgate[server]``, or a bare checkout on a GPU
    machine. What they share with the tests lives in ``batchgate.bench.harness``."""
    from batchgate._checkout import FOLDERS

    root = Path(__file__).resolve().parents[1]
    sources = [path for folder in ("batchgate", *FOLDERS) for path in (root / folder).rglob("*.py")
               if "__pycache__" not in path.parts]
    assert any(path.parts[-3:] == ("bench", "harness", "server.py") for path in sources)
    offenders = [f"{path.relative_to(root)}:{line} {name}" for path in sources
                 for line, name in imported_test_modules(path.read_text(encoding="utf-8"))]
    assert not offenders, offenders
