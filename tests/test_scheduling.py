"""The request path runs under SCHED_BATCH and model threads as the process started
(``batchgate.batcher.scheduling``, ``--request-scheduling``), in every mode, read from ``/proc``.
``--request-scheduling normal`` is in ``tests/test_settings.py``, and so are the threads'
CPUs under ``--model-cpus``; here, the intra-op threads a model gets under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchgate.clients import Client
from batchgate.bench.harness.server import start_process
from batchgate.bench.harness.repository import model_config, tensor, write_model
from tests.support.servers import SERVER_MODES, native_or_skip, threads

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling only")

MODEL = """
import torch


def build_model(parameters):
    return torch.nn.Identity()
"""


@pytest.mark.parametrize("mode", SERVER_MODES)
def test_request_path_under_sched_batch_and_model_threads_not(mode, tmp_path):
    if mode == "native":
        native_or_skip()
    write_model(tmp_path, model_config("ident", max_batch_size=4,
                                       input=[tensor("X", "FP32", [2])],
                                       output=[tensor("Y", "FP32", [2])]), MODEL)
    server = start_process(tmp_path, mode, models=["ident"])
    try:
        # The process that runs the models: its event loop (the main thread) is request path.
        runner = (server.supervisor.proc.pid if mode == "single"
                  else server.supervisor.pids("executor")[None])
        found = threads(runner, os.sched_getscheduler)
        assert found[runner][1] == os.SCHED_BATCH
        model = [policy for name, policy in found.values() if name == "ident-0-batch"]
        assert model == [os.SCHED_OTHER], found
        if mode == "single":
            return
        [frontend] = server.supervisor.pids("frontend").values()
        found = threads(frontend, os.sched_getscheduler)
        # Every thread of the native front end is request path.
        assert {policy for _, policy in found.values()} == {os.SCHED_BATCH}, found
        assert any(name.startswith("bg-worker") for name, _ in found.values())
    finally:
        server.stop()


THREADS_MODEL = """
import torch


class Threads(torch.nn.Module):
    def forward(self, x):
        return torch.full_like(x, float(torch.get_num_threads()))


def build_model(parameters):
    return Threads()
"""


def _intra_op_threads(tmp_path: Path, *args: str, parameters: dict | None = None
                      ) -> tuple[int, list[dict]]:
    """The intra-op threads a model's thread runs with, as the model itself reads them, and
    the server's log."""
    write_model(tmp_path, model_config("threads", max_batch_size=4,
                                       input=[tensor("X", "FP32", [1])],
                                       output=[tensor("Y", "FP32", [1])],
                                       parameters=parameters or {}), THREADS_MODEL)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    server = start_process(tmp_path, "single", models=["threads"],
                           extra_args=args, env=env)
    try:
        with Client(server.address, timeout_s=30) as client:
            y = client.infer("threads", {"X": np.zeros((1, 1), np.float32)})["Y"]
    finally:
        server.stop()
    return int(y[0, 0]), server.supervisor.events


def test_model_cpus_bound_a_models_default_intra_op_threads(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"--model-cpus needs two CPUs to split, and this process may run on "
                    f"{len(cpus)}")
    unbound, _ = _intra_op_threads(tmp_path / "anywhere")
    if unbound < 2:
        pytest.skip("torch's default is one intra-op thread here: nothing for the bound to lower")
    # One model CPU: one intra-op thread, not torch's default taking turns on it.
    bound, events = _intra_op_threads(tmp_path / "bound", "--model-cpus", str(cpus[-1]))
    assert bound == 1
    assert not any(e.get("event") == "intra_op_threads_exceed_model_cpus" for e in events)
    # More set by the model's config: as set, and the log says they take turns.
    more, events = _intra_op_threads(tmp_path / "more", "--model-cpus", str(cpus[-1]),
                                     parameters={"INTRA_OP_THREAD_COUNT": "2"})
    assert more == 2
    warned = [e for e in events if e.get("event") == "intra_op_threads_exceed_model_cpus"]
    assert warned and warned[0]["model"] == "threads" and warned[0]["model_cpus"] == [cpus[-1]]


SCRIPT = """
import json, os, threading
from batchgate.batcher import scheduling

if os.environ["STARTED"] == "batch":  # as under chrt --batch
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
scheduling.request_path(os.environ["POLICY"])
seen = {"main": scheduling.current()}

def thread():
    seen["inherited"] = scheduling.current()
    scheduling.model_thread("a-model-thread-name")
    seen["model"] = scheduling.current()
    seen["name"] = open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()

t = threading.Thread(target=thread)
t.start()
t.join()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("policy, started, expected", [
    ("batch", "normal", {"main": "batch", "inherited": "batch", "model": "normal"}),
    ("normal", "normal", {"main": "normal", "inherited": "normal", "model": "normal"}),
    # A policy chosen for the whole process (chrt --batch) is left to every thread.
    ("batch", "batch", {"main": "batch", "inherited": "batch", "model": "batch"}),
])
def test_threads_inherit_the_request_path_and_model_threads_take_the_process_policy(
        policy, started, expected):
    out = subprocess.run([sys.executable, "-c", SCRIPT],
                         env={**os.environ, "POLICY": policy, "STARTED": started}, check=True,
                         capture_output=True, text=True).stdout
    seen = json.loads(out)
    assert {k: seen[k] for k in expected} == expected
    assert seen["name"] == "a-model-thread-"  # 15 bytes: what Linux keeps


def test_an_unknown_policy_is_refused():
    from batchgate.batcher import scheduling

    with pytest.raises(ValueError, match="got 'fifo'"):
        scheduling.request_path("fifo")
