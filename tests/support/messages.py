"""KServe v2 messages built and read by hand, for tests that talk to the server's stub directly."""

from __future__ import annotations

import numpy as np

from batchgate.protos import inference_pb2 as pb


def infer_request(model: str, arrays: dict[str, np.ndarray], datatype: str = "FP32", **kw):
    req = pb.ModelInferRequest(model_name=model, **kw)
    for name, array in arrays.items():
        req.inputs.add(name=name, datatype=datatype, shape=array.shape)
        req.raw_input_contents.append(array.tobytes())
    return req


def output(response: pb.ModelInferResponse, name: str, dtype=np.float32) -> np.ndarray:
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        if tensor.name == name:
            return np.frombuffer(raw, dtype=dtype).reshape(tuple(tensor.shape))
    raise KeyError(name)
