"""Writes the fuzz targets' seed corpus (server/native/fuzz/corpus/<target>/): a few valid
messages of each kind the targets take, small, so that a run starts from the shapes real
traffic has. Run it again after changing what a target reads:

    .venv/bin/python server/native/fuzz/make_corpus.py
"""

from __future__ import annotations

import struct
from pathlib import Path

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import wire_pb2

CORPUS = Path(__file__).resolve().parent / "corpus"


def requests() -> dict[str, bytes]:
    raw = pb.ModelInferRequest(model_name="echo", id="raw")
    raw.inputs.add(name="IN_FP32", datatype="FP32", shape=[1, 3])
    raw.raw_input_contents.append(struct.pack("<3f", 1, 2, 3))
    raw.outputs.add(name="OUT_FP32")
    typed = pb.ModelInferRequest(model_name="any", id="typed")
    typed.inputs.add(name="IN_INT64", datatype="INT64", shape=[4]).contents.int64_contents.extend(
        [0, 1, -1, 2**40])
    typed.inputs.add(name="IN_BYTES", datatype="BYTES", shape=[2]).contents.bytes_contents.extend(
        [b"a", b"bc"])
    typed.inputs.add(name="IN_FP32", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
    typed.parameters["priority"].uint64_param = 1
    typed.parameters["timeout"].int64_param = 1000
    placed = pb.ModelInferRequest(model_name="any")
    tensor = placed.inputs.add(name="IN_FP32", datatype="FP32", shape=[2])
    tensor.parameters["shared_memory_region"].string_param = "r"
    tensor.parameters["shared_memory_byte_size"].uint64_param = 8
    return {"raw": raw.SerializeToString(), "typed": typed.SerializeToString(),
            "placed": placed.SerializeToString(),
            "unpacked": b"\x0a\x03any\x2a\x0c\x0a\x08IN_INT64\x2a\x00" + b"\x18\x01\x18\x02"}


def results() -> dict[str, bytes]:
    result = wire_pb2.Result(rid=1)
    for offset in (0, 256, 512):
        result.outputs.add(block=offset, offset=offset, nbytes=12, shape=[1, 3])
    placed = wire_pb2.Result(rid=2)
    placed.outputs.add(placed=True, shape=[1, 3])
    # The reply target reads two bytes first: stream or not, and how many outputs are asked.
    return {"three": b"\x00\x00" + result.SerializeToString(),
            "asked": b"\x01\x02\x00\x01" + result.SerializeToString(),
            "placed": b"\x00\x00" + placed.SerializeToString()}


def frames() -> dict[str, bytes]:
    frame = wire_pb2.ToFrontend(welcome=True)
    state = frame.models.add(name="m", state="READY", handle=3)
    state.spec.name, state.spec.version, state.spec.max_batch_size = "m", "1", 4
    state.spec.inputs.add(name="X", datatype="FP32", dims=[2])
    state.spec.outputs.add(name="Y", datatype="FP32", dims=[2])
    frame.models.add(name="gone", state="UNAVAILABLE", reason="unloaded")
    batch = frame.batches.add(rids=[1, 2], first_rows=[0, 1], rows=[1, 1], released=True)
    batch.outputs.add(block=0, row_bytes=8, tail=[2])
    frame.results.add(rid=3).outputs.add(block=256, offset=256, nbytes=8, shape=[1, 2])
    frame.failures.add(rid=4, code=14, message="lost")
    frame.released.append(5)
    return {"welcome": frame.SerializeToString()}


def main() -> None:
    for target, seeds in (("request", requests()), ("reply", results()), ("frame", frames())):
        folder = CORPUS / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in seeds.items():
            (folder / name).write_bytes(data)


if __name__ == "__main__":
    main()
