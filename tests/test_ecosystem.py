"""The ecosystem's own tools against our server: tritonclient (PyPI) and Triton's perf_analyzer.

tritonclient registers protobuf package ``inference`` in the default descriptor pool, as our
``protos`` do, so the two cannot share a process: its calls run in a subprocess that prints
JSON, and the assertions run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from batchgate.protos import inference_pb2 as pb
from batchgate.protos import inference_pb2_grpc
from tests.support.models import reference
from tests.support.tools import PERF_ANALYZER, PERF_ANALYZER_ANY_STABILITY, perf_analyzer_unavailable

# Slow (tritonclient and perf_analyzer runs in subprocesses): make test-fast leaves it out.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

TRITONCLIENT_SCRIPT = textwrap.dedent('''
    import json, sys, queue
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    url = sys.argv[1]
    out = {}
    c = grpcclient.InferenceServerClient(url=url)
    out["live"] = c.is_server_live()
    out["ready"] = c.is_server_ready()
    out["model_ready"] = c.is_model_ready("mlp")
    out["server_name"] = c.get_server_metadata().name
    meta = c.get_model_metadata("mlp", as_json=True)
    out["inputs"] = meta["inputs"]
    config = c.get_model_config("mlp", as_json=True)["config"]
    out["max_batch_size"] = config["max_batch_size"]
    out["preferred"] = config.get("dynamic_batching", {}).get("preferred_batch_size", [])

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 512), dtype=np.float32)
    np.save(sys.argv[2] + "/x.npy", x)
    inp = grpcclient.InferInput("INPUT__0", [2, 512], "FP32")
    inp.set_data_from_numpy(x)
    res = c.infer("mlp", [inp], request_id="tc-1", outputs=[grpcclient.InferRequestedOutput("OUTPUT__0")])
    out["raw_id"] = res.get_response().id
    np.save(sys.argv[2] + "/raw.npy", res.as_numpy("OUTPUT__0"))

    # Typed contents: the same request with the data in contents.fp32_contents instead.
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    import grpc
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(url))
    req = service_pb2.ModelInferRequest(model_name="mlp")
    t = req.inputs.add(name="INPUT__0", datatype="FP32", shape=[2, 512])
    t.contents.fp32_contents.extend(x.reshape(-1).tolist())
    typed = stub.ModelInfer(req)
    np.save(sys.argv[2] + "/typed.npy",
            np.frombuffer(typed.raw_output_contents[0], np.float32).reshape(2, 512))

    # FP16 through the echo model: all its inputs, FP16 checked bit for bit.
    types = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
             "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
             "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
             "BF16": np.uint16}
    inputs = []
    half = rng.standard_normal((1, 3)).astype(np.float16)
    for dt, npt in types.items():
        a = half if dt == "FP16" else np.ones((1, 3), dtype=npt)
        i = grpcclient.InferInput("IN_" + dt, [1, 3], dt)
        if dt == "BF16":
            i._raw_content = a.tobytes()
        else:
            i.set_data_from_numpy(a)
        inputs.append(i)
    res = c.infer("echo", inputs)
    out["fp16_equal"] = bool((res.as_numpy("OUT_FP16") == half).all())
    out["fp16_dtype"] = str(res.as_numpy("OUT_FP16").dtype)

    # A stream of 4 requests, one of them bad.
    answers = queue.Queue()
    c.start_stream(callback=lambda result, error: answers.put((result, error)))
    for k in range(4):
        name = "WRONG" if k == 2 else "INPUT__0"
        i = grpcclient.InferInput(name, [1, 512], "FP32")
        i.set_data_from_numpy(x[:1])
        c.async_stream_infer("mlp", [i], request_id=f"s{k}")
    got = [answers.get(timeout=30) for _ in range(4)]
    c.stop_stream()
    out["stream_ok"] = sorted(r.get_response().id for r, e in got if e is None)
    out["stream_errors"] = [str(e) for r, e in got if e is not None]

    try:
        c.infer("nope", [inp])
    except InferenceServerException as e:
        out["not_found_status"] = e.status()
    stats = c.get_inference_statistics("mlp", as_json=True)
    out["stats_count"] = int(stats["model_stats"][0].get("inference_count", 0))
    print(json.dumps(out))
''')


def run_tritonclient(address: str, workdir: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", TRITONCLIENT_SCRIPT, address, str(workdir)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tritonclient_speaks_to_us(server, tmp_path):
    out = run_tritonclient(server.address, tmp_path)
    assert out["live"] and out["ready"] and out["model_ready"]
    assert out["server_name"] == "batchgate"
    assert out["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": ["-1", "512"]}]
    assert out["max_batch_size"] == 64
    assert out["raw_id"] == "tc-1"
    x = np.load(tmp_path / "x.npy")
    expected = reference("mlp", x)
    np.testing.assert_allclose(np.load(tmp_path / "raw.npy"), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.load(tmp_path / "typed.npy"), np.load(tmp_path / "raw.npy"))
    assert out["fp16_equal"] and out["fp16_dtype"] == "float16"
    assert out["stream_ok"] == ["s0", "s1", "s3"]
    assert len(out["stream_errors"]) == 1 and "has no input 'WRONG'" in out["stream_errors"][0]
    assert out["not_found_status"] == "StatusCode.NOT_FOUND"
    assert out["stats_count"] >= 2



@pytest.mark.skipif(perf_analyzer_unavailable() is not None,
                    reason=str(perf_analyzer_unavailable()))
def test_perf_analyzer_concurrency_8_without_errors(server, tmp_path):
    import grpc

    with grpc.insecure_channel(server.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)

        def stats():
            return stub.ModelStatistics(pb.ModelStatisticsRequest(name="mlp")).model_stats[0]

        before = stats()
        csv = tmp_path / "pa.csv"
        done = subprocess.run(
            [str(PERF_ANALYZER), "-m", "mlp", "-i", "grpc", "-u", server.address,
             "--concurrency-range", "8:8", "--measurement-interval", "1000",
             "--max-trials", "6", *PERF_ANALYZER_ANY_STABILITY, "-f", str(csv)],
            capture_output=True, text=True, timeout=240,
        )
        after = stats()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Inferences/Second" in csv.read_text()
    assert after.inference_stats.fail.count == before.inference_stats.fail.count
    assert after.inference_stats.success.count > before.inference_stats.success.count
    # perf_analyzer itself reports errors when any request failed.
    assert "error" not in done.stdout.lower().replace("errors: 0", ""), done.stdout[-2000:]
