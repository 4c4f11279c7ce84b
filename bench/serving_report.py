"""The serving benchmark's figures, its targets, and the table it prints
(``batchgate.bench.serving`` measures; this turns what it measured into the report)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from batchgate.bench.machine import machine
from batchgate.server.config.settings import cpus_text

CEILING_BATCH = 64
THREADS = 1


@dataclasses.dataclass(frozen=True)
class Targets:
    """What a mode is held to on a 2-core machine."""

    ratio: float
    p99_ms: float
    added_p50_ms: float
    outside_model_us: float | None = None  # server CPU per request outside the model
    executor_us: float | None = None  # the executor's part of it


TARGETS = {
    "native": Targets(0.7, 35.0, 0.5, outside_model_us=100.0, executor_us=40.0),
    "single": Targets(0.45, 50.0, 1.0),
}


def summarize(
    args: argparse.Namespace,
    before: dict[int, dict[str, Any]],
    after: dict[int, dict[str, Any]],
    modes: dict[str, dict[str, Any]],
    config: Any,
    wall_s: float,
    from_idle: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every figure of the run; ``config`` is the model's ModelConfig as the server reports it;
    ``from_idle``: the model at batch 1 called from idle (``measure_from_idle``), if measured."""
    ceiling = _mean(before[CEILING_BATCH]["samples_per_s"], after[CEILING_BATCH]["samples_per_s"])
    batch1_ms = _mean(before[1]["batch_p50_ms"], after[1]["batch_p50_ms"])
    params = {key: value.string_value for key, value in config.parameters.items()} if config else {}
    dynamic = config.dynamic_batching if config is not None and config.HasField("dynamic_batching") else None
    results: dict[str, Any] = {}
    for mode, measured in modes.items():
        if "skipped" in measured:
            results[mode] = measured
            continue
        target = TARGETS.get(mode)  # the floor is a yardstick: no targets
        yardstick = modes.get("floor", {}).get("steps", {})
        by_generator = {}
        for generator, (low, high) in measured["steps"].items():
            ratio = high.perf.row.throughput_per_s / ceiling
            # The same throughput against the model alone at the batch size the server formed.
            at_batch = after.get(high.batch_size) if high.batch_size else None
            at_batch_per_s = at_batch["samples_per_s"] if at_batch else None
            added_p50 = low.perf.row.p50_ms - batch1_ms
            checks = {}
            if target is not None:
                checks = {
                    "ratio": (ratio, target.ratio, ratio >= target.ratio),
                    "c64_p99_ms": (high.perf.row.p99_ms, target.p99_ms,
                                   high.perf.row.p99_ms <= target.p99_ms),
                    "added_p50_ms": (added_p50, target.added_p50_ms,
                                     added_p50 <= target.added_p50_ms),
                }
                for key, value, limit in (("outside_model_us", high.outside_model_us,
                                           target.outside_model_us),
                                          ("executor_us", high.executor_us, target.executor_us)):
                    if limit is not None and value is not None:
                        checks[key] = (value, limit, value <= limit)
            # The same load generator against the floor, in this run.
            floor_low, floor_high = yardstick.get(generator, (None, None))
            by_generator[generator] = {
                "steps": [low.as_dict(), high.as_dict()],
                "figures": {
                    "c64_throughput_per_s": high.perf.row.throughput_per_s,
                    "ratio": ratio,
                    "inprocess_at_batch_per_s": at_batch_per_s,
                    "vs_inprocess_at_batch": (high.perf.row.throughput_per_s / at_batch_per_s
                                              if at_batch_per_s else None),
                    "c64_p99_ms": high.perf.row.p99_ms,
                    "c1_p50_ms": low.perf.row.p50_ms,
                    "added_p50_ms": added_p50,
                    "added_p50_from_idle_ms": (low.perf.row.p50_ms - from_idle["batch_p50_ms"]
                                               if from_idle else None),
                    "outside_model_us": high.outside_model_us,
                    "executor_us": high.executor_us,
                    "frontend_us": high.frontend_us,
                    "vs_floor": (high.perf.row.throughput_per_s
                                 / floor_high.perf.row.throughput_per_s
                                 if floor_high and mode != "floor" else None),
                    "p50_over_floor_ms": (low.perf.row.p50_ms - floor_low.perf.row.p50_ms
                                          if floor_low and mode != "floor" else None),
                },
                "targets": {key: {"value": v, "target": t, "pass": ok}
                            for key, (v, t, ok) in checks.items()},
            }
        results[mode] = {"load_generators": by_generator,
                         "server_command": measured["server_command"],
                         "server_exit_code": measured["exit_code"]}
    return {
        "machine": machine(),
        "model": args.model,
        "settings": {
            "version": before[CEILING_BATCH]["version"],
            "device": before[CEILING_BATCH]["device"],
            "torch": before[CEILING_BATCH]["torch"],
            "inprocess_threads": THREADS,
            "server_intra_op_threads": params.get("INTRA_OP_THREAD_COUNT"),
            "max_batch_size": config.max_batch_size if config else None,
            "preferred_batch_sizes": list(dynamic.preferred_batch_size) if dynamic else None,
            "max_queue_delay_us": dynamic.max_queue_delay_microseconds if dynamic else None,
            "max_inflight_batches": params.get("max_inflight_batches"),
            "server_args": args.server_arg,
            "load_cpus": list(getattr(args, "load_cpus", None) or []) or None,
            "seconds_per_step": args.seconds_per_step,
        },
        "inprocess": {"before": before, "after": after},
        "ceiling_samples_per_s": ceiling,
        "inprocess_batch1_ms": batch1_ms,
        "inprocess_batch1_from_idle": from_idle,
        "modes": results,
        "wall_s": wall_s,
    }


def render(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["settings"]
    before, after = report["inprocess"]["before"], report["inprocess"]["after"]
    b64, a64 = before[str(CEILING_BATCH)], after[str(CEILING_BATCH)]
    b1, a1 = before["1"], after["1"]

    def opt(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    delay = s["max_queue_delay_us"]
    batching = (
        f"preferred {s['preferred_batch_sizes']}, max queue delay {delay} µs"
        if delay is not None else "no dynamic batching"
    )
    lines = [
        f"machine:  {m['usable_cores']} usable cores of {m['cores']}, {m['cpu_model']}, "
        f"Linux {m['kernel']}, Python {m['python']}, torch {s['torch']}, grpcio {m['grpcio']}",
        f"model:    {report['model']} v{s['version']} on {s['device']}, max_batch_size "
        f"{s['max_batch_size']}, {batching}",
        f"settings: {s['inprocess_threads']} intra-op thread in-process, server "
        f"INTRA_OP_THREAD_COUNT={s['server_intra_op_threads']}, max_inflight_batches="
        f"{s['max_inflight_batches']}; closed loop on loopback, {s['seconds_per_step']:g} s "
        f"windows; extra server flags: {' '.join(s['server_args']) or 'none'}; load generators "
        f"on {'CPU ' + cpus_text(s['load_cpus']) if s.get('load_cpus') else 'every CPU'}",
        f"ceiling:  in-process batch 64 {report['ceiling_samples_per_s']:,.0f} samples/s (before "
        f"{b64['samples_per_s']:,.0f}, after {a64['samples_per_s']:,.0f}); batch 1 p50 "
        f"{report['inprocess_batch1_ms']:.2f} ms (before {b1['batch_p50_ms']:.2f}, after "
        f"{a1['batch_p50_ms']:.2f})",
        *([f"from idle: in-process batch 1 p50 {idle['batch_p50_ms']:.2f} ms with the thread "
           f"asleep {idle['idle_ms']:.2f} ms before each call (the fastest c=1 step's p50 less "
           "the batch-1 time)"] if (idle := report.get("inprocess_batch1_from_idle")) else []),
        "at the served batch sizes (after): " + (", ".join(
            f"batch {size} {result['samples_per_s']:,.0f} samples/s"
            for size, result in after.items() if size not in (str(CEILING_BATCH), "1")) or "none"),
        "",
    ]
    header = ("mode", "load", "c=64 /s", "ratio", "c=64 batch", "vs in-process at that batch",
              "c=64 p99 ms", "added p50 ms", "added p50 vs model from idle ms",
              "outside model µs/req", "executor µs/req", "front end µs/req",
              "front-end threads busy (largest share)")
    rows = [header]
    verdicts = []
    for mode, result in report["modes"].items():
        if "skipped" in result:
            rows.append((mode, "skipped", result["skipped"], *[""] * (len(header) - 3)))
            continue
        for generator, r in result["load_generators"].items():
            f, t = r["figures"], r["targets"]
            high = r["steps"][1]
            spread = high["frontend_threads"]

            def mark(key: str, text: str) -> str:
                return text if key not in t else f"{text} {'✓' if t[key]['pass'] else '✗'}"

            rows.append((
                mode, generator, f"{f['c64_throughput_per_s']:,.0f}",
                mark("ratio", f"{f['ratio']:.2f}"), opt(high["mean_batch_size"], ".1f"),
                opt(f.get("vs_inprocess_at_batch"), ".2f"),
                mark("c64_p99_ms", f"{f['c64_p99_ms']:.1f}"),
                mark("added_p50_ms", f"{f['added_p50_ms']:+.2f}"),
                opt(f.get("added_p50_from_idle_ms"), "+.2f"),
                mark("outside_model_us", opt(f["outside_model_us"], ".0f")),
                mark("executor_us", opt(f["executor_us"], ".0f")),
                opt(f["frontend_us"], ".0f"),
                "n/a" if spread is None else
                f"{spread['busy_threads']} ({spread['largest_share']:.0%})",
            ))
            for key, check in t.items():
                verdicts.append(f"{mode}/{generator} {key}: {check['value']:.3g} vs "
                                f"{check['target']:g}: {'pass' if check['pass'] else 'short'}")
        if result["server_exit_code"] != 0:
            verdicts.append(f"{mode}: exit {result['server_exit_code']} after SIGTERM")
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    lines.append("")
    against = [
        f"  {mode}/{generator}: c=64 {f['vs_floor']:.2f} of the floor's throughput, c=1 p50 "
        f"{f['p50_over_floor_ms']:+.2f} ms over the floor's"
        for mode, result in report["modes"].items() if "load_generators" in result
        for generator, r in result["load_generators"].items()
        if (f := r["figures"]).get("vs_floor") is not None]
    if against:
        lines.append("against the floor (batchgate-floor: the same model, no Python; same run):")
        lines.extend(against)
        lines.append("")
    lines.append("targets (2-core machine): " + "; ".join(
        f"{mode} ratio ≥ {t.ratio}, p99 ≤ {t.p99_ms:g} ms, added p50 ≤ {t.added_p50_ms} ms"
        + (f", outside the model ≤ {t.outside_model_us:g} µs (executor ≤ {t.executor_us:g})"
           if t.outside_model_us else "")
        for mode, t in TARGETS.items() if mode in report["modes"]))
    lines.extend(f"  {v}" for v in verdicts)
    lines.append(f"\nwhole run: {report['wall_s']:.0f} s")
    return "\n".join(lines)


def _mean(a: float, b: float) -> float:
    return (a + b) / 2
