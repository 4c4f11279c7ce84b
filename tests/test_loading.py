"""Model artifacts -> nn.Module: model.pt, model.pt2, model.py, and the example models."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from batchgate.batcher.errors import LoadError
from batchgate.batcher.loading import find_artifact, load_module

EXAMPLES = Path(__file__).resolve().parent.parent / "models"

# Writing TorchScript fixtures is what these tests are for; torch 2.13 deprecates the API.
pytestmark = pytest.mark.filterwarnings(r"ignore:`torch\.jit\.:DeprecationWarning")


def tiny_module() -> nn.Module:
    generator = torch.Generator().manual_seed(7)
    module = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5))
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return module.eval()


def load(version_dir: Path, *, filename: str | None = None, **parameters: str) -> nn.Module:
    return load_module(version_dir, filename=filename, parameters=parameters, device="cpu")


def write_model_py(version_dir: Path, source: str) -> Path:
    version_dir.mkdir(parents=True, exist_ok=True)
    path = version_dir / "model.py"
    path.write_text(textwrap.dedent(source))
    return path


SCALE_MODEL = """
    import torch
    from torch import nn

    FACTOR = {factor}

    class Scale(nn.Module):
        def __init__(self, factor):
            super().__init__()
            self.factor = factor
            self.dropout = nn.Dropout(0.9)

        def forward(self, x):
            return self.dropout(x) * self.factor

    def build_model(parameters):
        return Scale(FACTOR * float(parameters.get("extra", "1")))  # left in train mode
"""


# -- the three artifact kinds ----------------------------------------------------------------


def test_torchscript_model_pt(tmp_path):
    module = tiny_module()
    torch.jit.save(torch.jit.script(module.train()), str(tmp_path / "model.pt"))
    loaded = load(tmp_path)
    assert isinstance(loaded, torch.jit.ScriptModule)
    assert not loaded.training  # eval mode: dropout is off
    x = torch.randn(5, 4)
    torch.testing.assert_close(loaded(x), module.eval()(x))


def test_exported_model_pt2(tmp_path):
    module = tiny_module()
    batch = torch.export.Dim("batch")
    program = torch.export.export(module, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(tmp_path / "model.pt2"))
    loaded = load(tmp_path)
    x = torch.randn(7, 4)
    torch.testing.assert_close(loaded(x), module(x))


def test_python_model_py_gets_parameters_and_eval_mode(tmp_path):
    write_model_py(tmp_path, SCALE_MODEL.format(factor=3.0))
    loaded = load(tmp_path, extra="2")
    assert not loaded.training and not loaded.dropout.training
    x = torch.ones(2, 4)
    torch.testing.assert_close(loaded(x), x * 6.0)


def test_two_model_py_files_do_not_collide(tmp_path):
    write_model_py(tmp_path / "a" / "1", SCALE_MODEL.format(factor=2.0))
    write_model_py(tmp_path / "b" / "1", SCALE_MODEL.format(factor=5.0))
    first = load(tmp_path / "a" / "1")
    second = load(tmp_path / "b" / "1")
    x = torch.ones(1, 4)
    torch.testing.assert_close(first(x), x * 2.0)
    torch.testing.assert_close(second(x), x * 5.0)
    assert type(first).__module__ != type(second).__module__


def test_reloading_model_py_reads_the_file_again(tmp_path):
    write_model_py(tmp_path, SCALE_MODEL.format(factor=2.0))
    assert load(tmp_path)(torch.ones(1)).item() == 2.0
    write_model_py(tmp_path, SCALE_MODEL.format(factor=4.0))
    assert load(tmp_path)(torch.ones(1)).item() == 4.0


# -- which file ----------------------------------------------------------------------------


def test_lookup_order_prefers_model_pt(tmp_path):
    torch.jit.save(torch.jit.script(tiny_module()), str(tmp_path / "model.pt"))
    write_model_py(tmp_path, SCALE_MODEL.format(factor=2.0))
    assert find_artifact(tmp_path) == tmp_path / "model.pt"
    assert isinstance(load(tmp_path), torch.jit.ScriptModule)


def test_default_model_filename_is_used_instead(tmp_path):
    torch.jit.save(torch.jit.script(tiny_module()), str(tmp_path / "weights.ts"))
    write_model_py(tmp_path, SCALE_MODEL.format(factor=2.0))
    assert isinstance(load(tmp_path, filename="weights.ts"), torch.jit.ScriptModule)
    with pytest.raises(LoadError, match="other.pt"):
        load(tmp_path, filename="other.pt")


def test_missing_artifact_names_the_folder_and_files(tmp_path):
    with pytest.raises(LoadError) as info:
        load(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "model.pt or model.pt2 or model.py" in str(info.value)


# -- failures ------------------------------------------------------------------------------


def test_corrupt_torchscript_names_the_file(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"not a zip archive")
    with pytest.raises(LoadError, match="model.pt: cannot load it as TorchScript"):
        load(tmp_path)


def test_corrupt_exported_program_names_the_file(tmp_path):
    (tmp_path / "model.pt2").write_bytes(b"not a zip archive")
    with pytest.raises(LoadError, match="model.pt2: cannot load it as an exported program"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("import torch\n", "defines no build_model"),
        ("def build_model(parameters):\n    return 42\n", "got int"),
        (
            "def build_model(parameters):\n    raise RuntimeError('weights missing\\nsecond line')\n",
            "build_model(parameters) raised: RuntimeError: weights missing",
        ),
        ("import no_such_module_anywhere\n", "importing it raised: ModuleNotFoundError"),
        ("def build_model(parameters):\n", "importing it raised: IndentationError"),
        ("import sys\nsys.exit(3)\n", "importing it raised: SystemExit"),
    ],
)
def test_broken_model_py_gives_a_load_error_without_traceback(tmp_path, source, message):
    path = write_model_py(tmp_path, source)
    with pytest.raises(LoadError) as info:
        load(tmp_path)
    text = str(info.value)
    assert text.startswith(f"{path}: ")
    assert message in text
    assert "Traceback" not in text and "\n" not in text


# -- the example models --------------------------------------------------------------------


EXAMPLE_INPUTS = {
    "mlp": lambda g, n: torch.randn(n, 512, generator=g),
    "cnn": lambda g, n: torch.randn(n, 3, 32, 32, generator=g),
    "encoder": lambda g, n: torch.randint(0, 1000, (n, 16), generator=g),
}
EXAMPLE_OUTPUTS = {"mlp": (512,), "cnn": (10,), "encoder": (64,)}


@pytest.mark.parametrize("name", sorted(EXAMPLE_INPUTS))
def test_example_model_is_traced_seeded_and_batch_invariant(name):
    rng_before = torch.random.get_rng_state()
    module = load(EXAMPLES / name / "1")
    assert torch.equal(torch.random.get_rng_state(), rng_before), "build_model moved the global RNG"
    assert isinstance(module, torch.jit.ScriptModule)
    assert not module.training

    x = EXAMPLE_INPUTS[name](torch.Generator().manual_seed(1), 12)
    with torch.inference_mode():
        batched = module(x)
        alone = torch.cat([module(x[i : i + 1]) for i in range(len(x))])
        again = load(EXAMPLES / name / "1")(x)
    assert batched.shape == (12, *EXAMPLE_OUTPUTS[name])
    assert batched.dtype == torch.float32
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, batched, rtol=0, atol=0)  # same seed, same weights
    assert batched.abs().sum() > 0
