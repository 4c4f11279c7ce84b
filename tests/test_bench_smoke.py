"""The benchmark harness works: the in-process loop runs, and perf_analyzer's CSV reads back.

No timing is asserted: figures on a shared machine are for ``python -m batchgate.bench.serving`` to report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchgate.bench import inprocess, serving, serving_report, steps
from batchgate.bench._perf_analyzer import (
    PerfRow, PerfRun, parse_perf_analyzer_csv, run_perf_analyzer)
from batchgate.bench.steps import Step, parse_metrics
from batchgate.bench.harness.repository import write_model
from tests.support.models import xy_config

MODELS = Path(__file__).resolve().parent.parent / "models"

# Written by perf_analyzer 2.51 with -f (latencies in µs), and a --collect-metrics section
# after a blank line, which the parser must ignore.
PERF_ANALYZER_CSV = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency
1,210.379,7,1535,1179,43,1925,50,3,4335,5459,7873,10986
64,1401.11,4,29855,4399,503,10693,100,1,43018,61026,69082,87589

Concurrency,Avg GPU Utilization,Avg GPU Power Usage,Max GPU Memory Usage,Total GPU Memory
1,,,,
"""


def test_inprocess_measure_runs_the_mlp():
    result = inprocess.measure(MODELS / "mlp", batch_size=4, seconds=0.2)

    assert result["model"] == "mlp"
    assert result["batch_size"] == 4
    assert result["threads"] == 1
    assert result["calls"] >= 1
    assert result["samples_per_s"] > 0
    assert result["batch_p50_ms"] > 0


def test_inprocess_calls_from_idle_sleep_before_each_timed_call():
    model = inprocess.load(MODELS / "mlp")
    started = time.monotonic()
    result = inprocess.run(model, batch_size=1, seconds=0.3, idle_ms=20.0)

    assert result["idle_ms"] == 20.0
    # The sleeps are not timed, but they are slept: the loop took at least calls x 20 ms.
    assert time.monotonic() - started >= result["calls"] * 0.020
    assert result["seconds"] < result["calls"] * 0.020
    with pytest.raises(ValueError, match="idle_ms"):
        inprocess.run(model, batch_size=1, seconds=0.1, idle_ms=-1.0)


def test_suggested_buckets_pad_only_where_a_larger_size_measured_faster():
    # Going down from 8: 7, 6 and 5 pad up to 8 (it ran faster than each by over 3 %); 4 ran
    # faster than 8, so it is a bucket; 3 pads up to 4; 2 and 1 are faster than 4.
    p50_ms = {1: 1.0, 2: 2.0, 3: 3.0, 4: 2.5, 5: 3.5, 6: 3.4, 7: 3.6, 8: 3.0}
    assert inprocess.suggest_buckets(p50_ms, 0.03) == [1, 2, 4, 8]
    # Within the margin a size keeps its own bucket: no padding on the strength of noise.
    assert inprocess.suggest_buckets({1: 1.0, 2: 0.99}, 0.03) == [1, 2]
    assert inprocess.suggest_buckets({1: 1.0, 2: 0.99}, 0.0) == [2]
    with pytest.raises(ValueError, match="margin"):
        inprocess.suggest_buckets(p50_ms, 1.0)
    with pytest.raises(ValueError, match="no batch times"):
        inprocess.suggest_buckets({}, 0.03)


DOUBLE_MODEL = """
import torch


class Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


def build_model(parameters):
    return Double()
"""


def test_the_bucket_sweep_times_every_size_and_prints_the_parameter(tmp_path, capsys):
    write_model(tmp_path, xy_config("double", max_batch_size=6), DOUBLE_MODEL)
    written = tmp_path / "buckets.json"
    assert inprocess.main(["--model-repository", str(tmp_path), "--model", "double",
                           "--buckets", "--seconds", "0.02", "--json", str(written)]) == 0
    report = json.loads(written.read_text())
    p50_ms = {int(size): ms for size, ms in report["batch_p50_ms"].items()}
    assert sorted(p50_ms) == [1, 2, 3, 4, 5, 6]
    assert all(ms > 0 for ms in p50_ms.values())
    assert report["buckets"] == inprocess.suggest_buckets(p50_ms, 0.03)
    assert report["buckets"][-1] == 6
    listed = ",".join(map(str, report["buckets"]))
    assert f'parameters: {{ key: "buckets" value: {{ string_value: "{listed}" }} }}' in \
        capsys.readouterr().out
    with pytest.raises(SystemExit):
        inprocess.main(["--model-repository", str(tmp_path), "--model", "double", "--buckets",
                        "--bucket-margin", "1.5"])
    assert "--bucket-margin must lie in [0, 1)" in capsys.readouterr().err
    for extra in (["--batch", "4"], ["--idle-ms", "1"]):
        with pytest.raises(SystemExit):
            inprocess.main(["--model-repository", str(tmp_path), "--model", "double",
                            "--buckets", *extra])
        assert "it takes neither --batch nor --idle-ms" in capsys.readouterr().err


def test_inprocess_rejects_a_batch_over_max_batch_size():
    model = inprocess.load(MODELS / "mlp")
    with pytest.raises(ValueError, match="max_batch_size"):
        inprocess.run(model, batch_size=65, seconds=0.1)


def test_perf_analyzer_csv_rows_in_milliseconds():
    rows = parse_perf_analyzer_csv(PERF_ANALYZER_CSV)

    assert [r.concurrency for r in rows] == [1, 64]
    low, high = rows
    assert isinstance(low, PerfRow)
    assert low.throughput_per_s == pytest.approx(210.379)
    assert low.p50_ms == pytest.approx(4.335)
    assert low.p99_ms == pytest.approx(10.986)
    assert low.server_queue_ms == pytest.approx(1.179)
    assert high.throughput_per_s == pytest.approx(1401.11)
    assert high.p50_ms == pytest.approx(43.018)
    assert high.p90_ms == pytest.approx(61.026)
    assert high.p99_ms == pytest.approx(87.589)
    assert high.server_compute_infer_ms == pytest.approx(10.693)


def test_perf_analyzer_csv_without_latency_columns_is_an_error():
    with pytest.raises(RuntimeError, match="p99 latency"):
        parse_perf_analyzer_csv("Concurrency,Inferences/Second,p50 latency\n1,100,900\n")


def test_metrics_of_one_model_are_picked_out():
    text = """\
# HELP batchgate_batch_size Samples per executed batch.
batchgate_batch_size_count{model="cnn"} 3.0
batchgate_batch_size_count{model="mlp"} 590.0
batchgate_batch_size_sum{model="mlp"} 1588.0
batchgate_batches_total{model="mlp",reason="delay"} 12.0
"""
    samples = parse_metrics(text, "mlp")

    assert samples == {
        "batchgate_batch_size_count": 590.0,
        "batchgate_batch_size_sum": 1588.0,
        "batchgate_batches_total{reason=delay}": 12.0,
    }


def test_the_shared_memory_benchmark_model_and_table(tmp_path):
    import torch

    from batchgate.batcher.loading import latest_version, load_module
    from batchgate.bench import shared_memory

    root = shared_memory.write_repository(tmp_path)
    module = load_module(latest_version(root / "image"), filename=None, parameters={},
                         device="cpu")
    assert tuple(module(torch.zeros(2, 3, 224, 224)).shape) == (2, 10)

    def row(per_s, p99, cpu):
        return {"throughput_per_s": per_s, "p99_ms": p99, "server_cpu_us_per_request": cpu,
                "outside_model_us_per_request": cpu / 2, "mean_batch_size": 2.0}

    report = {"input_bytes": 602112, "concurrency": 4, "seconds": 3.0, "modes": {
        "single": {"rows": {"grpc": row(100, 10.0, 4000),
                            "system shared memory": row(150, 5.0, 1000)}},
        "native": {"skipped": "not built"}}}
    table = shared_memory.render(report)
    assert "| single | system shared memory | 150 | 5.0 ms | 1,000 µs | 500 µs | 2.0 | " \
           "**1.50** | **0.50** | **0.25** |" in table
    assert "| native | skipped: not built |" in table


def test_the_wire_read_benchmark_reads_every_frame_with_both_readers(tmp_path):
    from batchgate.bench import wire_read

    report = tmp_path / "wire.json"
    assert wire_read.main(["--frames", "300", "--gap-us", "0", "--rounds", "1",
                           "--json", str(report)]) == 0
    figures = json.loads(report.read_text())
    # measure() raises unless the reader handled every frame the child wrote.
    assert set(figures["us_per_frame"]) == set(wire_read.READERS)
    assert all(len(v) == 1 and v[0] > 0 for v in figures["us_per_frame"].values())


def test_the_intake_benchmark_times_both_forms_of_every_frame_size(tmp_path):
    from batchgate.bench import intake

    report = tmp_path / "intake.json"
    assert intake.main(["--sizes", "1,3", "--requests", "30", "--rounds", "2",
                        "--json", str(report)]) == 0
    rows = json.loads(report.read_text())["rows"]
    # take() raises unless the executor took every request of every frame.
    assert [row["requests_per_frame"] for row in rows] == [1, 3]
    assert all(len(row["rounds"][form]) == 2 and min(row["rounds"][form]) > 0
               for row in rows for form in intake.FORMS)


def _perf(concurrency: int, throughput: float, p50_ms: float = 2.0) -> PerfRun:
    return PerfRun(row=PerfRow(concurrency, throughput, p50_ms, 20.0), stability_percentage=0.0,
                   wall_s=4.0, cpu_s=1.0, command=["bench"])


def _step(concurrency: int, throughput: float, batches: float, samples: float):
    return Step(
        concurrency=concurrency,
        perf=_perf(concurrency, throughput),
        batches=batches, samples=samples, answered=samples, compute_s=1.0, model_cpu_s=1.0,
        queue_waits=samples, queue_s=0.1, reasons={}, cpu_s={"executor": 2.0, "frontend": 0.5},
        frontend_threads_s={"bg-worker-0": 0.25, "bg-worker-1": 0.25}, machine_busy_s=6.0)


def test_the_serving_ratio_is_split_at_the_batch_size_the_server_formed():
    """The c=64 throughput is also set against the in-process rate at the step's mean batch
    size (rounded), measured after the servers ran; the table shows both."""
    modes = {"native": {"steps": {"bench": [_step(1, 400.0, 1000, 1000),
                                            _step(64, 3000.0, 400, 12000)]},  # batch 30
                        "server_command": ["serve"], "exit_code": 0}}
    assert serving.served_batch_sizes(modes) == (30,)

    def inprocess(rates: dict[int, float]) -> dict[int, dict]:
        return {b: {"samples_per_s": r, "batch_p50_ms": 1.0, "version": "1", "device": "cpu",
                    "torch": "x"} for b, r in rates.items()}

    before, after = inprocess({64: 5000.0, 1: 800.0}), inprocess({64: 5000.0, 1: 800.0,
                                                                   30: 4000.0})
    args = argparse.Namespace(model="mlp", server_arg=[], seconds_per_step=4.0)
    # The c=1 step's p50 is 2 ms and the model's batch-1 time 1 ms: it idles 1 ms a request.
    assert serving.c1_idle_ms(modes, 1.0) == pytest.approx(1.0)
    from_idle = {"batch_size": 1, "batch_p50_ms": 1.25, "idle_ms": 1.0}
    report = serving_report.summarize(args, before, after, modes, None, 10.0, from_idle)
    figures = report["modes"]["native"]["load_generators"]["bench"]["figures"]
    assert figures["added_p50_ms"] == pytest.approx(1.0)
    assert figures["added_p50_from_idle_ms"] == pytest.approx(0.75)
    assert figures["ratio"] == pytest.approx(3000 / 5000)
    assert figures["inprocess_at_batch_per_s"] == 4000.0
    assert figures["vs_inprocess_at_batch"] == pytest.approx(3000 / 4000)
    table = serving_report.render(json.loads(json.dumps(report)))
    assert "vs in-process at that batch" in table
    assert "batch 30 4,000 samples/s" in table
    assert "from idle: in-process batch 1 p50 1.25 ms" in table
    row = next(line for line in table.splitlines() if line.startswith("native"))
    assert "0.75" in row.split() and "30.0" in row.split() and "+0.75" in row.split()
    assert "load generators on every CPU" in table
    assert report["settings"]["load_cpus"] is None
    args.load_cpus = (0,)
    report = serving_report.summarize(args, before, after, modes, None, 10.0, from_idle)
    assert report["settings"]["load_cpus"] == [0]
    assert "load generators on CPU 0" in serving_report.render(json.loads(json.dumps(report)))


def test_each_mode_is_read_against_the_floor_of_the_same_run():
    """The floor (batchgate-floor) is measured like a mode but held to no target; every mode's
    c=64 throughput and c=1 p50 are set against the floor's under the same load generator, and
    the c=1 idle of the from-idle column stays the servers' own."""
    modes = {
        "native": {"steps": {"bench": [_step(1, 400.0, 1000, 1000),
                                       _step(64, 3000.0, 400, 12000)]},
                   "server_command": ["serve"], "exit_code": 0},
        "floor": {"steps": {"bench": [dataclasses.replace(_step(1, 800.0, 1000, 1000),
                                                          perf=_perf(1, 800.0, p50_ms=1.4)),
                                      _step(64, 4000.0, 400, 12000)]},
                  "server_command": ["batchgate-floor"], "exit_code": 0},
    }
    before = after = {b: {"samples_per_s": 5000.0, "batch_p50_ms": 1.0, "version": "1",
                          "device": "cpu", "torch": "x"} for b in (64, 1, 30)}
    args = argparse.Namespace(model="mlp", server_arg=[], seconds_per_step=4.0)
    # The native c=1 step's p50 is 2 ms, the floor's 1.4, the model's batch-1 time 1 ms.
    assert serving.c1_idle_ms(modes, 1.0) == pytest.approx(1.0)
    report = serving_report.summarize(args, before, after, modes, None, 10.0)
    native = report["modes"]["native"]["load_generators"]["bench"]
    assert native["figures"]["vs_floor"] == pytest.approx(3000 / 4000)
    assert native["figures"]["p50_over_floor_ms"] == pytest.approx(2.0 - 1.4)
    assert set(native["targets"]) >= {"ratio", "c64_p99_ms", "added_p50_ms"}
    yardstick = report["modes"]["floor"]["load_generators"]["bench"]
    assert yardstick["targets"] == {} and yardstick["figures"]["vs_floor"] is None
    table = serving_report.render(json.loads(json.dumps(report)))
    assert "native/bench: c=64 0.75 of the floor's throughput, c=1 p50 +0.60 ms over the floor's" \
        in table
    floor_row = next(line for line in table.splitlines() if line.startswith("floor"))
    assert "✓" not in floor_row and "✗" not in floor_row
    assert "floor ratio" not in table  # the targets line names the modes' targets only


def test_a_floor_that_cannot_be_built_is_skipped_saying_why(monkeypatch, tmp_path):
    def unavailable(model_dir):
        raise serving.floor.FloorUnavailable("no compiler here")

    monkeypatch.setattr(serving, "start_floor", unavailable)
    monkeypatch.setattr(serving, "measure_inprocess", lambda *a, **k: {
        b: {"samples_per_s": 5000.0, "batch_p50_ms": 1.0, "version": "1", "device": "cpu",
            "torch": "x"} for b in (64, 1)})
    args = argparse.Namespace(model="mlp", model_repository=MODELS, parameter={}, modes=["floor"],
                              load_generators=["bench"], seconds_per_step=1.0, server_arg=[])
    report = serving.run(args)
    assert report["modes"]["floor"] == {"skipped": "no compiler here"}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs this process may run on, to confine a child to one")
def test_load_generators_started_while_confined_run_on_those_cpus_only():
    """``--load-cpus``: what load_step starts inside ``confined`` (the load generators) gets
    those CPUs; the benchmark's own CPUs, and so the servers' started after, are given back."""
    mine = os.sched_getaffinity(0)
    first = min(mine)
    probe = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with steps.confined((first,)):
        inside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert json.loads(inside) == [first]
    assert os.sched_getaffinity(0) == mine
    with steps.confined(None):
        anywhere = subprocess.run(probe, capture_output=True, text=True, check=True).stdout
    assert json.loads(anywhere) == sorted(mine)


def test_load_cpus_outside_the_usable_ones_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serving.main(["--load-cpus", "4095"])
    assert exit_info.value.code == 2
    assert "--load-cpus 4095: this process may run only on CPUs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serving.main(["--load-cpus", "one"])
    assert "--load-cpus must be a CPU list" in capsys.readouterr().err


def test_a_retried_perf_analyzer_run_counts_the_wall_and_cpu_of_every_attempt(tmp_path):
    """The server's CPU is read around the whole call; the load generator's cores and the
    machine's other cores are divided by the run's wall time, so it spans the failed attempt
    too (it did not: a retried step showed a 2-core machine's server using 4 cores)."""
    csv = tmp_path / "rows.csv"
    csv.write_text(PERF_ANALYZER_CSV)
    first = tmp_path / "first-attempt"
    fake = tmp_path / "perf_analyzer"
    fake.write_text(f"""#!{sys.executable}
import resource, shutil, sys, time
args = sys.argv[1:]
if args[args.index("--stability-percentage") + 1] == "20":
    started = time.monotonic()
    while resource.getrusage(resource.RUSAGE_SELF).ru_utime < 0.05:
        pass
    usage = resource.getrusage(resource.RUSAGE_SELF)
    open({str(first)!r}, "w").write(f"{{started}} {{usage.ru_utime + usage.ru_stime}}")
    sys.exit("unstable")
shutil.copy({str(csv)!r}, args[args.index("-f") + 1])
""")
    os.chmod(fake, 0o755)
    run = run_perf_analyzer(url="127.0.0.1:1", model="mlp", concurrency=64,
                            measurement_interval_ms=1000, perf_analyzer=fake)
    ended = time.monotonic()
    first_started, first_cpu_s = map(float, first.read_text().split())
    assert run.stability_percentage == 40.0 and run.row.throughput_per_s == 210.379
    assert ended - run.wall_s <= first_started
    assert run.cpu_s >= first_cpu_s


def test_the_attack_bench_runs_an_attack_beside_valid_load(tmp_path, capsys):
    from batchgate.bench import attacks

    written = tmp_path / "attacks.json"
    assert attacks.main(["--modes", "single", "--seconds", "0.5", "--clients", "2",
                         "--only", "asked for twice", "--json", str(written)]) == 0
    [result] = json.loads(written.read_text())["results"]
    [row] = result["rows"]
    assert row["status"] == "INVALID_ARGUMENT" and row["wrong"] == 0
    assert result["goodput_alone"] > 0 and row["goodput"] > 0
    assert set(row["peak_growth_bytes"]) == {"server"}
    assert result["metrics_bytes"] < attacks.METRICS_BOUND
    assert "| an output asked for twice | INVALID_ARGUMENT |" in capsys.readouterr().out


def test_the_attack_bench_reads_a_request_attack_against_the_same_bytes_sent_honestly(tmp_path):
    from batchgate.bench import attacks

    [attack] = [a for a in attacks.attacks() if a.name == "3,000,000 unknown fields"]
    honest = attacks.pb.ModelInferRequest.FromString(attack.honest)  # well formed
    assert abs(len(attack.honest) - attack.wire_bytes) <= 1
    assert len(honest.raw_input_contents[0]) > attack.wire_bytes - 64
    written = tmp_path / "attacks.json"
    assert attacks.main(["--modes", "single", "--seconds", "0.5", "--clients", "2",
                         "--only", "unknown fields", "--json", str(written)]) == 0
    [row] = json.loads(written.read_text())["results"][0]["rows"]
    assert row["status"] == "RESOURCE_EXHAUSTED" and row["wrong"] == 0
    assert row["honest_goodput"] > 0 and row["honest_ratio"] is not None
