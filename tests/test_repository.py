"""ModelRepository: loading, serving, reloading and unloading models of a repository folder."""

from __future__ import annotations

import asyncio
import shutil
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format

import batchgate.server.executor.repository as repository_module
from batchgate.batcher import loading
from batchgate.batcher.errors import InvalidRequest, LoadError, ModelNotFound, ModelUnavailable
from batchgate.batcher.request import InferenceRequest
from batchgate.protos import model_config_pb2
from batchgate.server.executor.load_override import LoadOverride, file_path
from batchgate.server.executor.repository import ModelRepository

EXAMPLES = Path(__file__).resolve().parent.parent / "models"
WAIT_S = 30.0  # upper bound for a thread to reach a gate; never reached when things work

DOUBLE_MODEL = """
    from torch import nn

    class Double(nn.Module):
        def forward(self, x):
            return x * 2.0

    def build_model(parameters):
        return Double()
"""

RAISING_FORWARD_MODEL = """
    from torch import nn

    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("forward is broken")

    def build_model(parameters):
        return Broken()
"""

SMALL_CONFIG = """
    backend: "pytorch"
    max_batch_size: 4
    input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
    output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 3 ] } ]
    dynamic_batching { max_queue_delay_microseconds: 100 }
    instance_group [ { count: 1 kind: KIND_CPU } ]
"""


class RecordingLog:
    """Stands in for the module's structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        def record(event: str, **fields) -> None:
            self.lines.append((level, event, fields))

        return record


class Harness:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.events: list[tuple[str, str]] = []
        self.repository = ModelRepository(
            root, cuda_available=False, on_state_change=self._on_state_change
        )
        self.hooks: dict[tuple[str, str], Callable[[], None]] = {}

    def _on_state_change(self, name: str, state: str) -> None:
        self.events.append((name, state))
        hook = self.hooks.get((name, state))
        if hook is not None:
            hook()

    def states(self, name: str) -> list[str]:
        return [state for model, state in self.events if model == name]

    def entry(self, name: str):
        [entry] = [e for e in self.repository.index() if e.name == name]
        return entry


@pytest.fixture
def make_harness(tmp_path):
    """A repository folder holding copies of the named example models."""

    def make(*examples: str) -> Harness:
        root = tmp_path / "repo"
        root.mkdir(exist_ok=True)
        for name in examples:
            shutil.copytree(
                EXAMPLES / name, root / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        return Harness(root)

    return make


@pytest.fixture
async def closing(make_harness):
    """make_harness, with every repository closed at the end of the test."""
    made: list[Harness] = []

    def make(*examples: str) -> Harness:
        harness = make_harness(*examples)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        await harness.repository.close(drain_timeout_s=10.0)


def add_model(root: Path, name: str, version: str, source: str, config: str | None = None) -> None:
    version_dir = root / name / version
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / "model.py").write_text(textwrap.dedent(source))
    if config is not None:
        (root / name / "config.pbtxt").write_text(textwrap.dedent(config))


async def infer(model, x: np.ndarray) -> np.ndarray:
    outputs = await model.infer(InferenceRequest([x], batch_size=x.shape[0]))
    return outputs["OUTPUT__0"]


def mlp_input(rows: int) -> np.ndarray:
    return np.random.default_rng(3).standard_normal((rows, 512), dtype=np.float32)


def mlp_reference(x: np.ndarray) -> np.ndarray:
    """The example MLP run directly, without the repository or the batcher."""
    module = loading.load_module(EXAMPLES / "mlp" / "1", filename=None, parameters={}, device="cpu")
    with torch.inference_mode():
        return module(torch.from_numpy(x)).numpy()


# -- start-up ----------------------------------------------------------------------------------


async def test_load_all_serves_every_example_model(closing):
    harness = closing("mlp", "cnn", "encoder")
    repository = harness.repository
    await repository.load_all()

    assert [(e.name, e.version, e.state, e.reason) for e in repository.index()] == [
        ("cnn", "1", "READY", ""),
        ("encoder", "1", "READY", ""),
        ("mlp", "1", "READY", ""),
    ]
    for name in ("mlp", "cnn", "encoder"):
        assert harness.states(name) == ["LOADING", "READY"]
    assert [m.spec.name for m in repository.loaded()] == ["cnn", "encoder", "mlp"]

    x = mlp_input(3)
    served = await infer(repository.get("mlp"), x)
    np.testing.assert_allclose(served, mlp_reference(x), rtol=1e-5, atol=1e-5)
    cnn = await infer(repository.get("cnn", "1"), np.zeros((2, 3, 32, 32), np.float32))
    assert cnn.shape == (2, 10)
    encoder = await infer(repository.get("encoder"), np.ones((5, 16), np.int64))
    assert encoder.shape == (5, 64)

    config = repository.config("mlp")
    assert (config.name, config.platform, config.max_batch_size) == ("mlp", "pytorch_libtorch", 64)
    assert config.parameters["INTRA_OP_THREAD_COUNT"].string_value == "1"
    assert repository.spec("encoder").inputs[0].datatype == "INT64"


async def test_a_broken_model_is_unavailable_and_the_others_serve(closing):
    harness = closing("mlp")
    add_model(harness.root, "broken", "1",
              "def build_model(parameters):\n    raise RuntimeError('no weights here')\n",
              config=SMALL_CONFIG)
    repository = harness.repository
    await repository.load_all()

    broken = harness.entry("broken")
    assert broken.state == "UNAVAILABLE"
    assert "failed to load" in broken.reason
    assert "model.py" in broken.reason and "no weights here" in broken.reason
    assert harness.states("broken") == ["LOADING", "UNAVAILABLE"]
    with pytest.raises(ModelUnavailable, match="failed to load"):
        repository.get("broken")
    with pytest.raises(LoadError, match="no weights here"):
        await repository.load("broken")

    assert harness.entry("mlp").state == "READY"
    assert (await infer(repository.get("mlp"), mlp_input(1))).shape == (1, 512)


async def test_a_model_failing_its_warm_up_is_unavailable(closing):
    harness = closing()
    add_model(harness.root, "m", "1", RAISING_FORWARD_MODEL, config=SMALL_CONFIG)
    with pytest.raises(LoadError, match="warm-up"):
        await harness.repository.load("m")
    assert harness.entry("m").state == "UNAVAILABLE"
    assert "warm-up" in harness.entry("m").reason


async def test_unsupported_config_fields_are_logged_once(closing, monkeypatch):
    recorder = RecordingLog()
    monkeypatch.setattr(repository_module, "log", recorder)
    harness = closing()
    extra = "response_cache { enable: true }\noptimization { cuda { graphs: true } }\n"
    add_model(harness.root, "m", "1", DOUBLE_MODEL, config=SMALL_CONFIG + extra)
    await harness.repository.load("m")
    warnings = [line for line in recorder.lines if line[0] == "warning"]
    assert len(warnings) == 1
    _, event, fields = warnings[0]
    assert event == "config_fields_not_supported"
    assert fields["model"] == "m"
    assert fields["fields"] == ["optimization.cuda.graphs", "response_cache"]
    assert all(line[2].get("model") == "m" for line in recorder.lines)


# -- names -------------------------------------------------------------------------------------


async def test_unknown_models_and_versions_are_not_found(closing):
    harness = closing("mlp")
    repository = harness.repository
    with pytest.raises(ModelUnavailable, match="not loaded"):
        repository.get("mlp")
    with pytest.raises(ModelNotFound):
        await repository.load("nope")
    with pytest.raises(ModelNotFound):
        await repository.unload("nope")
    with pytest.raises(ModelNotFound):
        repository.get("nope")
    await repository.load("mlp")
    with pytest.raises(ModelNotFound, match="serving version 1"):
        repository.get("mlp", "7")
    with pytest.raises(ModelNotFound):
        repository.config("mlp", "7")


async def test_version_folders_pick_the_highest_number_with_an_artifact(closing):
    harness = closing()
    add_model(harness.root, "m", "2", DOUBLE_MODEL, config=SMALL_CONFIG)
    (harness.root / "m" / "10").mkdir()  # no artifact: skipped
    add_model(harness.root, "m", "03", RAISING_FORWARD_MODEL)  # leading zero: ignored
    add_model(harness.root, "m", "latest", RAISING_FORWARD_MODEL)  # not a number: ignored
    await harness.repository.load("m")
    assert harness.repository.get("m").spec.version == "2"


# -- run-time changes --------------------------------------------------------------------------


class GatedModule(torch.nn.Module):
    """Wraps a model; once armed, each forward waits for ``release`` (the executor is busy)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def forward(self, x):
        if self.armed:
            self.entered.set()
            assert self.release.wait(WAIT_S)
        return self.inner(x)


async def test_unload_drains_then_refuses(closing, monkeypatch):
    harness = closing("mlp")
    repository = harness.repository
    gated: list[GatedModule] = []
    real_load_module = loading.load_module

    def gating_load_module(version_dir, **kwargs):
        gated.append(GatedModule(real_load_module(version_dir, **kwargs)))
        return gated[-1]

    monkeypatch.setattr(loading, "load_module", gating_load_module)
    # One batch in flight: while the gate holds it, every later request stays queued.
    with (harness.root / "mlp" / "config.pbtxt").open("a") as config:
        config.write('parameters: { key: "max_inflight_batches" value: { string_value: "1" } }\n')
    await repository.load("mlp")
    model = repository.get("mlp")
    assert model.spec.batching.max_inflight_batches == 1
    [gate] = gated
    gate.armed = True

    x = mlp_input(40)
    first = asyncio.create_task(infer(model, x[:1]))
    assert await asyncio.to_thread(gate.entered.wait, WAIT_S)  # the executor is now busy
    queued = [asyncio.create_task(infer(model, x[i : i + 1])) for i in range(1, len(x))]
    await asyncio.sleep(0)  # one loop turn: every task has put its request in the queue
    assert model.queue_depth == len(queued)

    refused_while_unloading: list[BaseException] = []

    def on_unloading() -> None:
        try:
            repository.get("mlp")
        except Exception as exc:
            refused_while_unloading.append(exc)
        gate.release.set()  # the model runs again only once the unload has begun

    harness.hooks[("mlp", "UNLOADING")] = on_unloading
    await repository.unload("mlp", drain_timeout_s=WAIT_S)

    results = await asyncio.gather(first, *queued)  # queued requests were answered, not dropped
    np.testing.assert_allclose(np.concatenate(results), mlp_reference(x), rtol=1e-5, atol=1e-5)
    assert len(refused_while_unloading) == 1
    assert isinstance(refused_while_unloading[0], ModelUnavailable)
    assert "unloading" in str(refused_while_unloading[0])

    assert harness.states("mlp") == ["LOADING", "READY", "UNLOADING", "UNAVAILABLE"]
    entry = harness.entry("mlp")
    assert (entry.state, entry.reason) == ("UNAVAILABLE", "unloaded")
    with pytest.raises(ModelUnavailable, match="unloaded"):
        repository.get("mlp")
    with pytest.raises(ModelUnavailable):
        await infer(model, x[:1])
    assert repository.loaded() == []

    await repository.load("mlp")  # and it can come back
    assert harness.entry("mlp").state == "READY"


async def test_a_new_version_is_served_after_the_swap(closing, monkeypatch):
    harness = closing("mlp")
    repository = harness.repository
    await repository.load("mlp")
    old = repository.get("mlp")
    x = mlp_input(2)
    old_answer = await infer(old, x)

    entered, release = threading.Event(), threading.Event()
    real_load_module = loading.load_module

    def gated_load_module(version_dir, **kwargs):
        if version_dir.name == "2":
            entered.set()
            assert release.wait(WAIT_S)
        return real_load_module(version_dir, **kwargs)

    monkeypatch.setattr(loading, "load_module", gated_load_module)
    add_model(harness.root, "mlp", "2", DOUBLE_MODEL)
    reload = asyncio.create_task(repository.load("mlp"))
    assert await asyncio.to_thread(entered.wait, WAIT_S)

    # Mid-reload: the old version still answers, and nothing looks unavailable.
    assert repository.get("mlp") is old
    assert (harness.entry("mlp").state, harness.entry("mlp").version) == ("READY", "1")
    np.testing.assert_array_equal(await infer(repository.get("mlp"), x), old_answer)

    release.set()
    await reload
    new = repository.get("mlp")
    assert new is not old and new.spec.version == "2"
    assert repository.get("mlp", "2") is new
    np.testing.assert_array_equal(await infer(new, x), x * 2.0)
    with pytest.raises(ModelNotFound):
        repository.get("mlp", "1")
    with pytest.raises(ModelUnavailable):
        await infer(old, x)  # the old version was stopped after the swap
    # Never unavailable in between; READY again when the new version replaced the old (front
    # ends then take its spec and config).
    assert harness.states("mlp") == ["LOADING", "READY", "READY"]
    assert harness.entry("mlp") == repository_module.ModelIndexEntry("mlp", "2", "READY", "")


async def test_a_failed_reload_keeps_the_old_version_serving(closing):
    harness = closing("mlp")
    repository = harness.repository
    await repository.load("mlp")
    old = repository.get("mlp")
    broken = "def build_model(parameters):\n    raise ValueError('bad v2')\n"
    add_model(harness.root, "mlp", "2", broken)
    with pytest.raises(LoadError, match="bad v2"):
        await repository.load("mlp")
    assert repository.get("mlp") is old
    entry = harness.entry("mlp")
    assert (entry.state, entry.version) == ("READY", "1")
    assert "reload failed" in entry.reason and "bad v2" in entry.reason
    assert (await infer(old, mlp_input(1))).shape == (1, 512)


async def test_loading_state_is_visible_while_the_model_loads(closing, monkeypatch):
    harness = closing("mlp")
    repository = harness.repository
    entered, release = threading.Event(), threading.Event()
    real_load_module = loading.load_module

    def gated_load_module(version_dir, **kwargs):
        entered.set()
        assert release.wait(WAIT_S)
        return real_load_module(version_dir, **kwargs)

    monkeypatch.setattr(loading, "load_module", gated_load_module)
    task = asyncio.create_task(repository.load("mlp"))
    assert await asyncio.to_thread(entered.wait, WAIT_S)
    assert harness.entry("mlp").state == "LOADING"
    with pytest.raises(ModelUnavailable, match="loading"):
        repository.get("mlp")
    release.set()
    await task
    assert harness.entry("mlp").state == "READY"


async def test_close_unloads_everything_and_refuses_new_loads(make_harness):
    harness = make_harness("mlp", "encoder")
    repository = harness.repository
    await repository.load_all()
    await repository.close(drain_timeout_s=WAIT_S)
    assert {(e.name, e.state) for e in repository.index()} == {
        ("mlp", "UNAVAILABLE"), ("encoder", "UNAVAILABLE"),
    }
    with pytest.raises(ModelUnavailable, match="closing"):
        await repository.load("mlp")


# -- loads that bring their own config and files -----------------------------------------------


def small_config(**fields) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig()
    text_format.Parse(textwrap.dedent(SMALL_CONFIG), config)
    for key, value in fields.items():
        setattr(config, key, value)
    return config


def files_of(source: str) -> dict:
    return {file_path("1/model.py"): textwrap.dedent(source).encode()}


async def test_a_config_override_replaces_the_config_for_that_load(closing):
    harness = closing()
    add_model(harness.root, "double", "1", DOUBLE_MODEL, SMALL_CONFIG)
    repository = harness.repository
    await repository.load("double")
    assert repository.config("double").max_batch_size == 4
    await repository.load("double", LoadOverride(small_config(max_batch_size=16)))
    assert repository.config("double").max_batch_size == 16
    assert repository.spec("double").max_batch_size == 16
    x = np.ones((16, 3), np.float32)
    np.testing.assert_array_equal(await infer(repository.get("double"), x), x * 2)
    # The override was for that load: a plain reload reads config.pbtxt again.
    await repository.load("double")
    assert repository.config("double").max_batch_size == 4


async def test_an_invalid_override_keeps_the_old_version_serving(closing):
    harness = closing()
    add_model(harness.root, "double", "1", DOUBLE_MODEL, SMALL_CONFIG)
    repository = harness.repository
    await repository.load("double")
    old = repository.get("double")
    # A config is replaced whole: max_batch_size alone declares no inputs.
    alone = model_config_pb2.ModelConfig(max_batch_size=16)
    with pytest.raises(LoadError, match="at least one input.*stands for the whole config.pbtxt"):
        await repository.load("double", LoadOverride(alone))
    with pytest.raises(InvalidRequest, match="name must be the model's name 'double'"):
        await repository.load("double", LoadOverride(small_config(name="other")))
    outside = small_config(default_model_filename="../../double/1/model.py")
    with pytest.raises(LoadError, match="default_model_filename must be a file name"):
        await repository.load("double", LoadOverride(outside))
    assert repository.get("double") is old
    assert repository.config("double").max_batch_size == 4
    assert harness.entry("double").state == "READY"


async def test_files_are_served_from_a_private_folder_removed_with_their_version(closing):
    harness = closing()
    repository = harness.repository
    # No folder of that name in the repository: the files are the whole model folder.
    await repository.load("fresh", LoadOverride(small_config(), files_of(DOUBLE_MODEL)))
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(await infer(repository.get("fresh"), x), x * 2)
    assert not (harness.root / "fresh").exists()  # nothing written into the repository
    [first] = list(repository._files_root.iterdir())
    assert (first / "fresh" / "1" / "model.py").read_bytes() == files_of(DOUBLE_MODEL)[
        file_path("1/model.py")]
    assert first.stat().st_mode & 0o077 == 0  # private

    plus_one = DOUBLE_MODEL.replace("x * 2.0", "x + 1.0")
    await repository.load("fresh", LoadOverride(small_config(), files_of(plus_one)))
    np.testing.assert_array_equal(await infer(repository.get("fresh"), x), x + 1)
    [second] = list(repository._files_root.iterdir())  # the replaced version's are gone
    assert second != first

    await repository.unload("fresh")
    assert list(repository._files_root.iterdir()) == []
    await repository.load("fresh", LoadOverride(small_config(), files_of(DOUBLE_MODEL)))
    root = repository._files_root
    await repository.close(drain_timeout_s=WAIT_S)
    assert not root.exists()


async def test_a_failed_files_load_keeps_the_old_version_and_leaves_no_files(closing):
    harness = closing()
    add_model(harness.root, "double", "1", DOUBLE_MODEL, SMALL_CONFIG)
    repository = harness.repository
    await repository.load("double")
    old = repository.get("double")
    raising = "def build_model(parameters):\n    raise ValueError('no weights')\n"
    with pytest.raises(LoadError) as caught:
        await repository.load("double", LoadOverride(small_config(), files_of(raising)))
    # Named as the client sent it, not where it was written.
    assert str(caught.value).startswith("file:1/model.py: build_model(parameters) raised")
    assert "no weights" in str(caught.value)
    with pytest.raises(LoadError, match="'double' failed its warm-up"):
        await repository.load("double", LoadOverride(
            small_config(), files_of(RAISING_FORWARD_MODEL)))
    with pytest.raises(LoadError, match="no version folder under the load's files holds"):
        await repository.load("double", LoadOverride(
            small_config(), {file_path("warmup/x"): b""}))
    assert repository.get("double") is old
    assert list(repository._files_root.iterdir()) == []
    entry = harness.entry("double")
    assert entry.state == "READY" and "reload failed" in entry.reason


@pytest.mark.parametrize("path", [
    "", "/1/model.py", "1", "1/", "1//model.py", "1/./model.py", "1/../../x", "../x",
    "config.pbtxt", "labels.txt", "01/model.py", "0/model.py", "x/model.py", "1\\model.py",
    "1/a\x00b", "1/" + "a" * 256,
])
def test_file_paths_stay_inside_the_version_and_warmup_folders(path):
    with pytest.raises(InvalidRequest, match="inside the model folder"):
        file_path(path)


def test_file_paths_that_are_accepted():
    assert file_path("1/model.py") == Path("1/model.py")
    assert file_path("12/sub/weights.bin").parts == ("12", "sub", "weights.bin")
    assert file_path("warmup/input0").parts == ("warmup", "input0")


def test_a_load_override_is_checked_whole():
    with pytest.raises(InvalidRequest, match="need its config too"):
        LoadOverride(None, files_of(DOUBLE_MODEL))
    with pytest.raises(InvalidRequest, match="'1/a' of the load is also a folder of '1/a/b'"):
        LoadOverride(small_config(), {file_path("1/a"): b"", file_path("1/a/b"): b""})
