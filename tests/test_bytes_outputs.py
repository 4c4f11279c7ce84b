"""BYTES outputs from a Python model, through tritonclient (PyPI), in every server mode.

The ``strings`` test model (tests/support/models.py) takes BYTES and returns BYTES three ways (a
numpy object array, a list of rows of bytes, a list of str) beside an INT64 tensor; a batch
whose first element names a fault returns that fault. tritonclient cannot share a process with
our ``protos`` (both register package ``inference``), so its calls run in a subprocess that
saves what it got, and the assertions run here.

A TorchScript or exported model cannot return BYTES: one whose config declares a BYTES output
is refused at load, with the output named.
"""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from batchgate.batcher.errors import ModelExecutionError
from batchgate.batcher.model import ServedModel
from batchgate.batcher.request import InferenceRequest
from batchgate.batcher.spec import BatchingConfig, ModelSpec, TensorSpec
from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from batchgate.server.frontend.codec import bytes_encoding, bytes_row_offsets
from batchgate.bench.harness.repository import model_config, renamed, tensor, write_config

OUTPUTS = ("UPPER", "SWAPPED", "JOINED", "LENGTH")
FAULTS = ("int", "float", "short", "unbatched", "object")

SCRIPT = textwrap.dedent('''
    import json, pickle, queue, sys
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    url, workdir = sys.argv[1], sys.argv[2]
    OUTPUTS = ("UPPER", "SWAPPED", "JOINED", "LENGTH")
    c = grpcclient.InferenceServerClient(url=url)
    out = {"outputs": c.get_model_metadata("strings", as_json=True)["outputs"]}

    def inputs(rows):
        text = np.array(rows, dtype=object)
        i = grpcclient.InferInput("TEXT", list(text.shape), "BYTES")
        i.set_data_from_numpy(text)
        return [i]

    def save(name, result, outputs=OUTPUTS):
        with open(f"{workdir}/{name}.pickle", "wb") as f:
            pickle.dump([result.as_numpy(o) for o in outputs], f)

    four = [[b"ab", b"c"], [b"", b"\\xff\\x00z"], ["h\\u00e9".encode(), b"x"], [b"q", b"rs"]]
    save("four", c.infer("strings", inputs(four)))
    only = c.infer("strings", inputs(four), outputs=[grpcclient.InferRequestedOutput("JOINED")])
    out["only_names"] = [t.name for t in only.get_response().outputs]
    save("only", only, ("JOINED",))

    # Three requests of 1, 1 and 2 rows fill one batch of 4: each must get its own rows back.
    def stats():
        s = c.get_inference_statistics("strings", as_json=True)["model_stats"][0]
        return (int(s["inference_stats"].get("success", {}).get("count", 0)),
                int(s.get("execution_count", 0)))

    before = stats()
    answers = queue.Queue()
    parts = [four[:1], four[1:2], four[2:]]
    for k, rows in enumerate(parts):
        c.async_infer("strings", inputs(rows), request_id=f"r{k}",
                      callback=lambda result, error: answers.put((result, error)))
    got = [answers.get(timeout=60) for _ in parts]
    out["split_errors"] = [str(e) for _, e in got if e is not None]
    for result, error in got:
        if error is None:
            save("split_" + result.get_response().id, result)
    after = stats()
    out["split_requests"] = after[0] - before[0]
    out["split_batches"] = after[1] - before[1]

    out["faults"] = {}
    for fault in ("int", "float", "short", "unbatched", "object"):
        try:
            c.infer("strings", inputs([[fault.encode(), b"x"]] + four[1:]))
            out["faults"][fault] = None
        except InferenceServerException as e:
            out["faults"][fault] = [e.status(), e.message()]
    # A failed batch does not break the model.
    save("after_faults", c.infer("strings", inputs(four)))
    print(json.dumps(out))
''')


def run_tritonclient(address: str, workdir: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, address, str(workdir)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def saved(workdir: Path, name: str) -> list[np.ndarray]:
    with open(workdir / f"{name}.pickle", "rb") as f:
        return pickle.load(f)


def expected(rows: list[list[bytes]]) -> list[np.ndarray]:
    """What the ``strings`` model answers for ``rows``, built here independently."""
    upper = np.array([[w.upper() for w in row] for row in rows], dtype=object)
    swapped = np.array([[row[1], row[0]] for row in rows], dtype=object)
    joined = np.array([[(b"+".join(row).decode("latin-1") + "é").encode()] for row in rows],
                      dtype=object)
    length = np.array([[len(w) for w in row] for row in rows], dtype=np.int64)
    return [upper, swapped, joined, length]


FOUR = [[b"ab", b"c"], [b"", b"\xff\x00z"], ["hé".encode(), b"x"], [b"q", b"rs"]]


def assert_outputs(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g, w)
        assert g.tolist() == w.tolist()


@pytest.fixture(scope="module")
def answers(server, tmp_path_factory) -> tuple[dict, Path]:
    workdir = tmp_path_factory.mktemp(f"bytes-{server.mode}")
    return run_tritonclient(server.address, workdir), workdir


def test_metadata_declares_the_bytes_outputs(answers):
    out, _ = answers
    assert [(o["name"], o["datatype"], o["shape"]) for o in out["outputs"]] == [
        ("UPPER", "BYTES", ["-1", "2"]), ("SWAPPED", "BYTES", ["-1", "2"]),
        ("JOINED", "BYTES", ["-1", "1"]), ("LENGTH", "INT64", ["-1", "2"])]


def test_bytes_outputs_come_back_as_the_model_returned_them(answers):
    out, workdir = answers
    assert_outputs(saved(workdir, "four"), expected(FOUR))
    assert out["only_names"] == ["JOINED"]
    assert_outputs(saved(workdir, "only"), expected(FOUR)[2:3])


def test_one_batch_is_split_per_request_by_rows(answers):
    out, workdir = answers
    assert out["split_errors"] == []
    assert (out["split_requests"], out["split_batches"]) == (3, 1)
    for rid, rows in (("r0", FOUR[:1]), ("r1", FOUR[1:2]), ("r2", FOUR[2:])):
        assert_outputs(saved(workdir, f"split_{rid}"), expected(rows))


def test_bad_bytes_outputs_fail_their_batch_saying_what_the_model_returned(answers):
    out, workdir = answers
    faults = out["faults"]
    assert all(f is not None and f[0] == "StatusCode.INTERNAL" for f in faults.values()), faults
    message = {name: f[1] for name, f in faults.items()}
    assert message["int"] == (
        "model 'strings' returned BYTES output 'UPPER' with an element of type int: "
        "BYTES elements must be bytes or str")
    assert message["float"] == (
        "model 'strings' returned BYTES output 'UPPER' as a torch.float32 tensor: a BYTES "
        "output must be a numpy object, bytes_ or str_ array, or a list with one entry per row")
    assert message["short"] == (
        "model 'strings' returned output 'JOINED' with shape (3, 1) for a batch of 4: "
        "the batch dimension must be kept")
    assert message["unbatched"] == (
        "model 'strings' returned output 'SWAPPED' with shape (8,) for a batch of 4: "
        "the batch dimension must be kept")
    assert message["object"] == (
        "model 'strings' returned INT64 output 'LENGTH' as a numpy object array: only a "
        "BYTES (TYPE_STRING) output may hold bytes or str; return a tensor")
    assert_outputs(saved(workdir, "after_faults"), expected(FOUR))


# -- refused at load ------------------------------------------------------------------------------

ARTIFACT_CONFIG = model_config(
    "artifact", max_batch_size=4, input=[tensor("INPUT__0", "FP32", [2])],
    output=[tensor("OUTPUT__0", "FP32", [2]), tensor("LABEL", "BYTES", [1])])


class _Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _write_artifact(folder: Path, kind: str) -> None:
    write_config(folder, renamed(ARTIFACT_CONFIG, folder.name))
    (folder / "1").mkdir(exist_ok=True)
    module = _Double().eval()
    if kind == "model.pt":
        with warnings.catch_warnings():  # torch's deprecation of TorchScript
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(torch.jit.script(module), str(folder / "1" / kind))
    else:
        exported = torch.export.export(module, (torch.zeros(2, 2),))
        torch.export.save(exported, str(folder / "1" / kind))


@pytest.mark.parametrize("artifact, what", [("model.pt", "TorchScript"),
                                            ("model.pt2", "an exported program")])
def test_a_compiled_model_with_a_bytes_output_is_refused_at_load(server, model_repository,
                                                                 artifact, what):
    name = "bytes_" + artifact.replace(".", "_")
    folder = model_repository / name
    _write_artifact(folder, artifact)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name),
                                         timeout=120)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            reason = (f"{artifact} is {what}, which cannot return BYTES: output 'LABEL' is "
                      "declared TYPE_STRING; serve this model from a model.py")
            assert reason in err.value.details()
            index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30)
            [entry] = [m for m in index.models if m.name == name]
            assert entry.state == "UNAVAILABLE" and reason in entry.reason
    finally:
        shutil.rmtree(folder)


# -- the rules, through the batch loop with fake models (no server) ---------------------------------

def _spec(output_dims=(1,), max_batch_size=4, output_type="BYTES") -> ModelSpec:
    return ModelSpec(
        name="fake", version="1", platform="test",
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", output_type, output_dims),),
        batching=BatchingConfig(max_batch_size=max_batch_size), warmup=False)


async def _infer(module, spec: ModelSpec | None = None, rows: int = 2) -> np.ndarray:
    spec = spec or _spec()
    model = ServedModel(spec, module)
    model.start()
    try:
        shape = (rows, 2) if spec.batching.max_batch_size else (2,)
        x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
        return (await model.infer(InferenceRequest([x], batch_size=rows)))["y"]
    finally:
        model.stop(drain_timeout_s=5)


def _rows(x: torch.Tensor) -> list[str]:
    return [f"{v:g}é" for v in x[:, 0].tolist()]


@pytest.mark.parametrize("module", [
    lambda x: (np.array(_rows(x)).reshape(-1, 1),),  # a numpy str_ array
    lambda x: (np.array([r.encode() for r in _rows(x)]).reshape(-1, 1),),  # bytes_
    lambda x: np.array([[r.encode()] for r in _rows(x)], dtype=object),  # alone, not in a tuple
    lambda x: (_rows(x),),  # a list: one str per row
    lambda x: {"y": [[r] for r in _rows(x)]},  # a list of rows, each a list
    lambda x: ([np.array([r], dtype=object) for r in _rows(x)],),  # a list of arrays
], ids=["str_", "bytes_", "object", "list", "nested", "arrays"])
async def test_every_form_of_bytes_output_becomes_an_object_array_of_bytes(module):
    got = await _infer(module)
    assert got.dtype == object and got.shape == (2, 1)
    assert got.tolist() == [["0é".encode()], ["2é".encode()]]


async def test_a_model_without_batching_returns_its_declared_dims():
    got = await _infer(lambda x: (["a", b"b", "c"],), _spec((3,), max_batch_size=0), rows=1)
    assert got.tolist() == [b"a", b"b", b"c"]


async def test_a_bytes_output_next_to_fixed_numeric_inputs_is_split_per_request():
    model = ServedModel(_spec(), lambda x: (_rows(x),))
    model.start()
    try:
        requests = [InferenceRequest([np.full((rows, 2), v, np.float32)], batch_size=rows)
                    for v, rows in ((1.0, 1), (2.0, 3))]
        got = await asyncio.gather(*(model.infer(r) for r in requests))
    finally:
        model.stop(drain_timeout_s=5)
    assert [g["y"].tolist() for g in got] == [[["1é".encode()]], [["2é".encode()]] * 3]


@pytest.mark.parametrize("module, spec, message", [
    (lambda x: ([["a"], ["b", "c"]],), _spec(),
     "returned BYTES output 'y' as a list whose rows differ in shape"),
    (lambda x: ([b"a", 3],), _spec(),
     "returned BYTES output 'y' with an element of type int: BYTES elements must be bytes or str"),
    (lambda x: (["\ud800", "b"],), _spec(),
     "returned BYTES output 'y' with a str element that cannot be encoded as UTF-8"),
    (lambda x: ([["a", "b"], ["c", "d"]],), _spec(),
     "returned BYTES output 'y' with shape (2, 2) for a batch of 2: its configuration "
     "declares dims [1]"),
    (lambda x: (np.array(["a", "b"]),), _spec(),
     "returned BYTES output 'y' with shape (2,) for a batch of 2: its configuration "
     "declares dims [1]"),
    (lambda x: (["a", "b", "c"],), _spec(),
     "returned output 'y' with shape (3, 1) for a batch of 2: the batch dimension must be kept"),
    (lambda x: (np.zeros(2, np.float64),), _spec(),
     "returned BYTES output 'y' as a numpy float64 array: a BYTES output must be"),
    (lambda x: (None,), _spec(), "returned BYTES output 'y' as NoneType"),
    (lambda x: (np.array([["a"], ["b"]], dtype=object),), _spec(output_type="FP32"),
     "returned FP32 output 'y' as a numpy object array: only a BYTES (TYPE_STRING) output"),
    (lambda x: (np.array(["a"]),), _spec((1,), max_batch_size=0, output_type="FP32"),
     "returned FP32 output 'y' as a numpy <U1 array: only a BYTES (TYPE_STRING) output"),
], ids=["ragged", "int", "surrogate", "dims", "flat", "rows", "float", "none", "object",
        "unbatched-str"])
async def test_what_a_bytes_output_cannot_be_fails_the_batch_saying_what_it_was(module, spec,
                                                                                  message):
    with pytest.raises(ModelExecutionError) as err:
        await _infer(module, spec, rows=1 if not spec.batching.max_batch_size else 2)
    assert str(err.value).startswith("model 'fake' ")
    assert message in str(err.value)


def test_bytes_row_offsets_slice_a_batch_encoding_into_each_request_rows():
    batch = np.array([[b"ab", b""], [b"xyz", b"q"], [b"", b"\x00"]], dtype=object)
    data, offsets = bytes_encoding(batch), bytes_row_offsets(batch)
    assert offsets.tolist() == [0, 10, 22, 31] and offsets[-1] == len(data)
    for first, rows in ((0, 1), (1, 2), (0, 3)):
        assert data[offsets[first]:offsets[first + rows]] == bytes_encoding(batch[first:first + rows])
