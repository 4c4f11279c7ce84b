"""``batchgate bench``: against real servers on port 0, short runs, figures checked for sense.

No timing is asserted as an upper bound; the one lower bound (open-loop latency of a slow
model) follows from the model's own sleep and the schedule, and is reached only when latency
is counted from the intended send time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from batchgate.bench.loadgen import arrivals, cli, driver, plan, scrape, workload
from batchgate.bench.loadgen.options import add_arguments
from batchgate.bench.loadgen.report import LAYOUT, layout_problems
from batchgate.bench.harness.repository import model_config, tensor, write_model
from tests.support import EXAMPLE_MODELS
from tests.support.models import FAILING_CONFIG, FAILING_MODEL
from tests.support.servers import start_server

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SERVICE_S = 0.05

# admission off: the bench's own deadline accounting is under test, and admission control would
# refuse some of these requests at the door (RESOURCE_EXHAUSTED) instead of letting them expire.
SLOW_CONFIG = model_config(
    "slow", max_batch_size=0, input=[tensor("INPUT__0", "FP32", [2])],
    output=[tensor("OUTPUT__0", "FP32", [2])], instance_group=[{"kind": "KIND_CPU", "count": 1}],
    parameters={"warmup": "false", "admission": "false"})
SLOW_MODEL = f'''
import time

import torch


class Slow(torch.nn.Module):
    """Takes {SERVICE_S} s per request, whatever the load: a server that cannot keep up."""

    def forward(self, x):
        time.sleep({SERVICE_S})
        return x + 1


def build_model(parameters):
    return Slow()
'''


def _repository(root: Path) -> Path:
    (root / "mlp").symlink_to(EXAMPLE_MODELS / "mlp", target_is_directory=True)
    write_model(root, SLOW_CONFIG, SLOW_MODEL)
    write_model(root, FAILING_CONFIG, FAILING_MODEL)
    return root


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory):
    """A single-process server with mlp, a slow model and a failing one."""
    running = start_server(_repository(tmp_path_factory.mktemp("bench-models")))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def other_server(tmp_path_factory):
    """A second server with the same mlp, for --compare."""
    root = tmp_path_factory.mktemp("bench-other")
    (root / "mlp").symlink_to(EXAMPLE_MODELS / "mlp", target_is_directory=True)
    running = start_server(root)
    yield running
    running.stop()


def bench(tmp_path: Path, *args: str) -> dict:
    """``batchgate bench ARGS --json FILE`` in this process; the JSON it wrote."""
    out = tmp_path / "bench.json"
    code = cli.main([*args, "--quiet", "--json", str(out)])
    assert code == 0
    return json.loads(out.read_text())


def counts_add_up(entry: dict) -> None:
    assert entry["sent"] == entry["ok"] + sum(entry["errors"].values())
    for group in (*entry["by_model"].values(), *entry["by_priority"].values()):
        assert group["sent"] == group["ok"] + sum(group["errors"].values())
    assert sum(g["sent"] for g in entry["by_model"].values()) == entry["sent"]


# -- against a real server -----------------------------------------------------------------------


def test_counts_add_up_by_status_code_and_match_the_servers(server, tmp_path):
    """A mix of a good model, one that raises (INTERNAL) and one sent a bad shape
    (INVALID_ARGUMENT): every request is counted once, under its code, as the server counted it."""
    thirteens = tmp_path / "thirteens.npz"
    np.savez(thirteens, INPUT__0=np.full((1, 2), 13, dtype=np.float32))  # the model raises on 13
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, INPUT__0=np.zeros((1, 3), dtype=np.float32))  # dims are [2]
    report = bench(tmp_path, "-u", server.address, "-m", "mlp:2", "-m", "failing", "-m", "spare",
                   "--input-data", f"failing={thirteens}", "--input-data", f"spare={wrong}",
                   "--concurrency", "4", "--requests", "30", "--warmup-s", "0",
                   "--metrics-url", server.metrics_url)

    (entry,) = report["steps"]
    counts_add_up(entry)
    assert entry["sent"] == 30
    by_model = entry["by_model"]
    assert by_model["mlp"]["ok"] == by_model["mlp"]["sent"] > 0
    assert by_model["failing"]["errors"] == {"INTERNAL": by_model["failing"]["sent"]}
    assert by_model["spare"]["errors"] == {"INVALID_ARGUMENT": by_model["spare"]["sent"]}
    assert set(entry["errors"]) == {"INTERNAL", "INVALID_ARGUMENT"}
    # The server's own count of the run, from /metrics, is the same, status by status.
    assert entry["server_metrics"]["requests"] == {"OK": entry["ok"], **entry["errors"]}


def test_an_unknown_model_stops_the_run_naming_the_code(bench_server):
    done = subprocess.run(
        [sys.executable, "-m", "batchgate.server.cli", "bench", "-u", bench_server.address, "-m", "nosuch",
         "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)

    assert done.returncode == 1
    assert "NOT_FOUND" in done.stderr and "nosuch" in done.stderr


def test_open_loop_latency_counts_from_the_intended_send_time(bench_server, tmp_path):
    """30 requests due 5 ms apart to a model that takes 50 ms each, from a client with one
    request in flight: each waits for the one before, so request k is answered about
    k × 45 ms after it was due. Counted from the actual send, every latency would be ~50 ms."""
    n, interval_s = 30, 0.005
    report = bench(tmp_path, "-u", bench_server.address, "-m", "slow", "--rate",
                   str(1 / interval_s), "--arrival", "constant", "--requests", str(n),
                   "--warmup-s", "0", "--max-outstanding", "1")

    (entry,) = report["steps"]
    counts_add_up(entry)
    assert entry["ok"] == n
    queued_s = (n - 1) * (SERVICE_S - interval_s)  # the last request's wait, at best
    assert entry["latency_ms"]["max"] >= 1e3 * (queued_s + SERVICE_S)
    assert entry["latency_ms"]["p99"] >= 1e3 * 0.5 * queued_s
    # The mechanism: requests left late because the client's one slot was busy.
    assert entry["send_lag_ms"]["max"] >= 1e3 * 0.5 * queued_s


def test_a_deadline_gives_goodput_and_slo_attainment(bench_server, tmp_path):
    """Every answer of the slow model comes after 50 ms: none is within a 20 ms deadline, and
    with the deadline sent as the gRPC deadline each request ends DEADLINE_EXCEEDED."""
    report = bench(tmp_path, "-u", bench_server.address, "-m", "slow", "--rate", "40",
                   "--arrival", "poisson", "--requests", "12", "--warmup-s", "0",
                   "--deadline-ms", "20", "--enforce-deadline", "grpc")

    (entry,) = report["steps"]
    counts_add_up(entry)
    assert entry["errors"] == {"DEADLINE_EXCEEDED": 12}
    assert entry["goodput_per_s"] == 0 and entry["slo_attainment"] == 0
    assert entry["latency_ms"]["p50"] is None  # no OK answer to take a percentile of


def test_a_mix_of_deadlines_holds_each_request_to_its_own(bench_server, tmp_path):
    """The slow model answers after 50 ms: the 20 ms class all ends DEADLINE_EXCEEDED (its
    gRPC deadline), the 5 s class all OK within its deadline, and the figures say so per class."""
    report = bench(tmp_path, "-u", bench_server.address, "-m", "slow", "--rate", "40",
                   "--arrival", "poisson", "--requests", "24", "--warmup-s", "0",
                   "--deadline-ms", "20:1", "--deadline-ms", "5000:1", "--enforce-deadline", "grpc")

    (entry,) = report["steps"]
    counts_add_up(entry)
    tight, loose = entry["by_deadline"]["20"], entry["by_deadline"]["5000"]
    assert tight["sent"] > 0 and loose["sent"] > 0
    assert tight["sent"] + loose["sent"] == entry["sent"] == 24
    assert tight["errors"] == {"DEADLINE_EXCEEDED": tight["sent"]} and tight["slo_attainment"] == 0
    assert loose["ok"] == loose["sent"] and loose["slo_attainment"] == 1.0
    assert entry["slo_attainment"] == pytest.approx(loose["sent"] / 24)
    assert report["settings"]["deadline_ms"] is None
    assert report["settings"]["deadlines"] == [{"ms": 20.0, "weight": 1.0},
                                               {"ms": 5000.0, "weight": 1.0}]
    assert layout_problems(report) == []


def test_json_layout_is_the_documented_one(bench_server, other_server, tmp_path):
    report = bench(tmp_path, "-u", bench_server.address, "--compare", other_server.address,
                   "-m", "mlp", "--priority", "0:1", "--priority", "1:1", "--rate", "50,100",
                   "--arrival", "bursty", "--burst-on-s", "0.2", "--burst-off-s", "0.1",
                   "--duration-s", "0.6", "--slice-s", "0.3", "--warmup-s", "0.1",
                   "--deadline-ms", "1000", "--metrics-url", bench_server.metrics_url,
                   "--compare-metrics-url", other_server.metrics_url)

    assert report["schema_version"] == 2
    assert layout_problems(report) == []
    assert len(report["steps"]) == 4 and len(report["comparison"]) == 2
    for entry in report["steps"]:
        counts_add_up(entry)
        assert set(entry["by_priority"]) == {"0", "1"}


def test_every_key_of_the_layout_is_documented():
    documented = (ROOT / "docs" / "benchmarks.md").read_text()

    def keys(layout: dict) -> set[str]:
        found = set()
        for key, value in layout.items():
            if key != "*":
                found.add(key.removesuffix("[]"))
            if isinstance(value, dict):
                found |= keys(value)
        return found

    missing = sorted(k for k in keys(LAYOUT) if f"`{k}`" not in documented)
    assert not missing, f"docs/benchmarks.md lacks JSON keys {missing}"


def test_layout_problems_name_a_missing_and_an_extra_key():
    problems = layout_problems({"schema_version": 1, "surprise": 2})

    assert ".surprise: not in the layout" in problems
    assert ".steps: missing" in problems


def test_compare_alternates_between_two_servers_and_gives_ratios(bench_server, other_server,
                                                                 tmp_path):
    """Each server's own /metrics counts exactly the requests the report says went to it."""
    report = bench(tmp_path, "-u", bench_server.address, "--compare", other_server.address,
                   "-m", "mlp", "--concurrency", "2", "--duration-s", "0.8", "--slice-s", "0.2",
                   "--warmup-s", "0", "--metrics-url", bench_server.metrics_url,
                   "--compare-metrics-url", other_server.metrics_url)

    base, other = report["steps"]
    assert (base["target"], other["target"]) == ("base", "compare")
    for entry in (base, other):
        counts_add_up(entry)
        assert entry["ok"] > 0
        assert entry["server_metrics"]["requests"] == {"OK": entry["ok"]}
    (row,) = report["comparison"]
    assert row["throughput_ratio"] == pytest.approx(other["throughput_per_s"] / base["throughput_per_s"])
    assert row["p99_ratio"] == pytest.approx(other["latency_ms"]["p99"] / base["latency_ms"]["p99"])


def test_compare_slices_wait_for_the_other_servers_backlog(bench_server):
    """Open loop at 100/s to a model that serves 20/s: each slice leaves a backlog, and the
    next slice (the other target) starts sending only once it has been answered."""
    with grpc.insecure_channel(bench_server.address) as channel:
        models = workload.describe_models(channel, ["slow"], workload.DataOptions())
    (variant,) = workload.build_variants(models, [], workload.DataOptions())[:1]
    shape = plan.RunShape([plan.LoadLevel(arrival=arrivals.Arrival("constant", 100))], 2, 0.0,
                          0.2, None, 0.1, np.array([1.0]), 0)
    (step,) = plan.build_steps(shape)
    config = driver.DriverConfig(urls=(bench_server.address,) * 2, payloads=(variant.payload,))

    with driver.Workers(config) as workers:
        (records,) = workers.run_step(step, time.monotonic() + 0.2)

    slices = records.segments
    assert [s.target for s in slices] == [0, 1, 0, 1]
    for before, after in itertools.pairwise(slices):
        assert (before.code == 0).all() and before.code.size == 10
        assert after.sent.min() >= before.done.max()


def test_plots_are_written(bench_server, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the 'plots' extra (matplotlib)")
    plots = tmp_path / "plots"
    bench(tmp_path, "-u", bench_server.address, "-m", "mlp", "--concurrency", "1,2",
          "--duration-s", "0.3", "--warmup-s", "0", "--plot", str(plots))

    for name in ("latency_cdf.png", "load_curve.png"):
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC


def test_worker_processes_share_the_load(bench_server, tmp_path):
    report = bench(tmp_path, "-u", bench_server.address, "-m", "mlp", "--workers", "2",
                   "--concurrency", "3", "--requests", "30", "--warmup-s", "0")

    (entry,) = report["steps"]
    counts_add_up(entry)
    assert entry["sent"] == entry["ok"] == 30


def test_the_table_is_printed(bench_server, capsys):
    assert cli.main(["-u", bench_server.address, "-m", "mlp", "--requests", "5",
                     "--warmup-s", "0", "--quiet"]) == 0

    out = capsys.readouterr().out
    assert "answers/s" in out and "p99.9 ms" in out and "c=1" in out


# -- the command line ----------------------------------------------------------------------------


def test_help_through_the_batchgate_command():
    done = subprocess.run([sys.executable, "-m", "batchgate.server.cli", "bench", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)

    assert done.returncode == 0
    assert "--concurrency" in done.stdout and "--rate" in done.stdout


def test_serve_help_still_lists_serve_and_bench():
    done = subprocess.run([sys.executable, "-m", "batchgate.server.cli", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)

    assert done.returncode == 0
    assert "serve" in done.stdout and "bench" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "4", "--rate", "10"], "not both"),
    (["--enforce-deadline", "grpc"], "needs --deadline-ms"),
    (["--compare", "x:1", "--requests", "5"], "--duration-s"),
    (["--concurrency", "4", "--max-outstanding", "2"], "open loop"),
    (["--model", "mlp:-1"], "weight > 0"),
    (["--deadline-ms", "0"], "must be > 0"),
    (["--deadline-ms", "50", "--deadline-ms", "50:2"], "must differ"),
])
def test_bad_command_lines_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["-m", "mlp", *args])

    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_every_bench_flag_is_documented():
    readme = (ROOT / "docs" / "benchmarks.md").read_text()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = [opt for action in parser._actions for opt in action.option_strings
             if opt.startswith("--") and opt != "--help"]

    missing = [flag for flag in flags if f"`{flag}`" not in readme]
    assert not missing, f"docs/benchmarks.md lacks bench flags {missing}"


# -- the parts -----------------------------------------------------------------------------------


def test_constant_arrivals_are_evenly_spaced():
    times = arrivals.schedule(arrivals.Arrival("constant", 200), np.random.default_rng(0),
                              start_s=1.0, duration_s=0.5)

    assert times.size == 100
    assert np.allclose(np.diff(times), 0.005)
    assert times[0] == 1.0


def test_bursty_arrivals_keep_out_of_the_off_periods():
    arrival = arrivals.Arrival("bursty", 1000, on_s=0.1, off_s=0.3)
    times = arrivals.schedule(arrival, np.random.default_rng(1), start_s=0.0, duration_s=2.0)

    phase = times % 0.4
    assert times.size > 100
    assert (phase < 0.1 + 1e-9).all()
    assert np.all(np.diff(times) >= 0)
    assert arrival.mean_rate_per_s == pytest.approx(250)


def test_bursty_arrivals_with_an_off_rate_keep_both_rates_and_their_mean():
    arrival = arrivals.Arrival("bursty", 1000, on_s=0.1, off_s=0.3, off_rate_per_s=200)
    times = arrivals.schedule(arrival, np.random.default_rng(2), start_s=0.25, duration_s=40.0)

    on = np.count_nonzero(times % 0.4 < 0.1)  # bursts are phased from 0, not from start_s
    assert np.all(np.diff(times) >= 0) and times[0] >= 0.25 and times[-1] < 40.25
    assert on == pytest.approx(1000 * 0.1 * 100, rel=0.05)
    assert times.size - on == pytest.approx(200 * 0.3 * 100, rel=0.05)
    assert arrival.mean_rate_per_s == pytest.approx(400)
    assert times.size == pytest.approx(400 * 40, rel=0.05)
    counted = arrivals.schedule(arrival, np.random.default_rng(2), start_s=0.25, count=500)
    assert counted.size == 500 and np.all(np.diff(counted) >= 0)
    with pytest.raises(ValueError, match="needs bursty"):
        arrivals.Arrival("poisson", 10, off_rate_per_s=5)


def test_a_count_of_poisson_arrivals_is_exact_and_seeded():
    arrival = arrivals.Arrival("poisson", 50)
    a = arrivals.schedule(arrival, np.random.default_rng(7), start_s=0.0, count=25)
    b = arrivals.schedule(arrival, np.random.default_rng(7), start_s=0.0, count=25)

    assert a.size == 25 and np.array_equal(a, b)


def test_split_deals_arrivals_and_senders_to_workers():
    shape = plan.RunShape([plan.LoadLevel(arrival=arrivals.Arrival("poisson", 100))], 1, 0.0,
                          1.0, None, 1.0, np.array([1.0]), 0)
    (step,) = plan.build_steps(shape)
    shares = plan.split(step, 3)

    merged = np.sort(np.concatenate([s.segments[0].times for s in shares]))
    assert np.array_equal(merged, step.segments[0].times)

    closed = plan.Step(plan.LoadLevel(concurrency=2), (plan.Segment(
        0, True, np.zeros(4, np.int32), requests=7, concurrency=2),))
    parts = [s.segments[0] for s in plan.split(closed, 3)]
    assert [p.concurrency for p in parts] == [1, 1, 0]
    assert [p.requests for p in parts] == [4, 3, 0]


def test_compare_slices_alternate_and_sum_to_the_duration():
    shape = plan.RunShape([plan.LoadLevel(concurrency=1)], 2, 0.5, 1.0, None, 0.4,
                          np.array([1.0]), 0)
    (step,) = plan.build_steps(shape)

    warmup = [(s.target, s.duration_s) for s in step.segments if not s.measured]
    measured = [(s.target, round(s.duration_s, 6)) for s in step.segments if s.measured]
    assert warmup == [(0, 0.5), (1, 0.5)]
    assert measured == [(0, 0.4), (1, 0.4), (0, 0.4), (1, 0.4), (0, 0.2), (1, 0.2)]


METRICS_BEFORE = """\
# TYPE batchgate_batch_size histogram
batchgate_batch_size_bucket{model="mlp",le="1.0"} 10.0
batchgate_batch_size_bucket{model="mlp",le="2.0"} 10.0
batchgate_batch_size_bucket{model="mlp",le="4.0"} 12.0
batchgate_batch_size_bucket{model="mlp",le="+Inf"} 12.0
batchgate_batch_size_count{model="mlp"} 12.0
batchgate_batch_size_sum{model="mlp"} 16.0
batchgate_batch_size_bucket{model="cnn",le="1.0"} 0.0
batchgate_batch_size_bucket{model="cnn",le="2.0"} 0.0
batchgate_batch_size_bucket{model="cnn",le="4.0"} 5.0
batchgate_batch_size_bucket{model="cnn",le="+Inf"} 5.0
batchgate_batch_size_count{model="cnn"} 5.0
batchgate_batch_size_sum{model="cnn"} 20.0
# TYPE batchgate_batches counter
batchgate_batches_total{model="mlp",reason="idle"} 12.0
"""
METRICS_AFTER = """\
# TYPE batchgate_batch_size histogram
batchgate_batch_size_bucket{model="mlp",le="1.0"} 14.0
batchgate_batch_size_bucket{model="mlp",le="2.0"} 16.0
batchgate_batch_size_bucket{model="mlp",le="4.0"} 20.0
batchgate_batch_size_bucket{model="mlp",le="+Inf"} 20.0
batchgate_batch_size_count{model="mlp"} 20.0
batchgate_batch_size_sum{model="mlp"} 40.0
batchgate_batch_size_bucket{model="cnn",le="1.0"} 0.0
batchgate_batch_size_bucket{model="cnn",le="2.0"} 0.0
batchgate_batch_size_bucket{model="cnn",le="4.0"} 9.0
batchgate_batch_size_bucket{model="cnn",le="+Inf"} 9.0
batchgate_batch_size_count{model="cnn"} 9.0
batchgate_batch_size_sum{model="cnn"} 36.0
# TYPE batchgate_batches counter
batchgate_batches_total{model="mlp",reason="idle"} 15.0
batchgate_batches_total{model="mlp",reason="full"} 5.0
# TYPE batchgate_gpu_utilization_ratio gauge
batchgate_gpu_utilization_ratio{gpu="0"} 0.5
"""


def test_server_side_figures_are_differenced_and_kept_to_the_runs_models():
    before, after = scrape.parse(METRICS_BEFORE), scrape.parse(METRICS_AFTER)
    readings = [scrape.parse(METRICS_AFTER), scrape.parse(METRICS_AFTER.replace(" 0.5", " 0.7"))]

    figures = scrape.server_side(before, after, readings, ["mlp"])

    assert figures["batches"] == 8
    assert figures["mean_batch_size"] == 3.0  # 24 samples in 8 batches; cnn left out
    assert figures["batch_size_histogram"] == {"1": 4.0, "2": 2.0, "4": 2.0}
    assert figures["dispatch_reasons"] == {"full": 5.0, "idle": 3.0}
    assert figures["gpu_utilization"] == {"0": pytest.approx(0.6)}
    assert figures["mean_queue_ms"] is None  # the server exported no queue histogram


def _metadata(*inputs: tuple[str, str, list[int]]):
    from batchgate.protos import inference_pb2 as pb

    return pb.ModelMetadataResponse(name="m", inputs=[
        pb.ModelMetadataResponse.TensorMetadata(name=n, datatype=t, shape=s) for n, t, s in inputs])


def test_inputs_follow_the_batch_dimension_and_the_given_shapes():
    metadata = _metadata(("TOKENS", "INT64", [-1, -1]), ("MASK", "BOOL", [-1, 16]))
    options = workload.DataOptions(batch=4, shapes={(None, "TOKENS"): (16,)})

    # ModelConfig says the model batches: the first dim is the batch, -1 dims come from --shape.
    batched = workload._model_inputs(metadata, 8, options)
    assert [i.shape for i in batched.inputs] == [(4, 16), (4, 16)]
    assert batched.samples == 4
    # A server without ModelConfig: a leading -1 is taken as the batch dimension.
    assert workload._model_inputs(metadata, None, options).inputs == batched.inputs
    # max_batch_size 0: the shape is sent as declared, and a -1 left unresolved is refused.
    with pytest.raises(workload.WorkloadError, match="--shape TOKENS"):
        workload._model_inputs(metadata, 0, workload.DataOptions())


def test_random_inputs_have_the_datatypes_size():
    from batchgate.bench.loadgen.workload import random_bytes

    rng = np.random.default_rng(0)
    assert len(random_bytes("FP16", (2, 3), rng)) == 12
    assert len(random_bytes("BF16", (4,), rng)) == 8
    assert len(random_bytes("INT64", (1, 16), rng, (0, 1000))) == 128
    # BYTES: a 4-byte length before each 8-byte element.
    assert len(random_bytes("BYTES", (3,), rng)) == 3 * (4 + 8)
    ids = np.frombuffer(random_bytes("INT64", (1000,), rng, (5, 9)), dtype="<i8")
    assert ids.min() >= 5 and ids.max() < 9


def test_readme_quotes_the_commands_behind_its_figures():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"batchgate bench .*--concurrency", readme)
    assert "python -m batchgate.bench.loadgen_vs_pa" in readme
