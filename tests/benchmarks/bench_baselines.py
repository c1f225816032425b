"""What the baselines cost: the gate over a large history, the band load at a run's start, and the
in-flight detector per step event.

- ``check``: ``runwatch baseline check``'s work (read the candidates from ClickHouse, select the
  history, compare every metric) for one run, with ``--summaries`` generated run summaries stored
  in the embedded ClickHouse (default 10,000: 2,000 runs of each of five baseline keys, two
  fingerprints), against the same with a tenth of them stored (the ratio shows how it scales).
- ``band_load``: ``BaselineReads.band`` at a run's start, ``--band-runs`` baseline runs of
  ``--band-steps`` steps stored as telemetry (what the worker does once per baseline key and
  fingerprint; then it is cached).
- ``detector``: the ``baseline_trajectory`` detector's ``update`` per step event with a band
  handed in, against the same event stream through a detector that does nothing (the harness).

Prints JSON. Not part of the test suite.

    .venv/bin/python tests/benchmarks/bench_baselines.py [--summaries 10000]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta

from runwatch.detectors.baselines.check import check_run
from runwatch.detectors.baselines.compare import BaselineConfig
from runwatch.detectors.baselines.summary import RunSummary, fingerprint_id
from runwatch.sinks.clickhouse import ClickHouseSink

NOW = datetime(2026, 11, 23, tzinfo=UTC)
KEYS = [f"bench/job-{i}" for i in range(5)]
FINGERPRINTS = [{"hardware": "a100x8"}, {"hardware": "h100x8"}]


def generated_summaries(n: int, seed: int = 0) -> list[RunSummary]:
    """``n`` plausible summaries spread over 60 days, keys and fingerprints round-robin."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        parts = FINGERPRINTS[i % 2]
        metrics: dict[str, float | None] = {
            "training_time_s": 3600 * rng.gauss(1, 0.02),
            "steps": 1000.0,
            "step_time_median_s": 0.5 * rng.gauss(1, 0.01),
            "step_time_p95_s": 0.6 * rng.gauss(1, 0.02),
            "samples_per_s": 512 * rng.gauss(1, 0.01),
            "mfu": 0.42 * rng.gauss(1, 0.01),
            "data_wait_share": 0.02 * rng.gauss(1, 0.05),
            "max_cuda_peak_bytes": 6e10 * rng.gauss(1, 0.002),
            "max_host_rss_bytes": 3e10 * rng.gauss(1, 0.01),
            "final_loss": 2.1 * rng.gauss(1, 0.005),
            "last_eval_loss": 2.2 * rng.gauss(1, 0.005),
            "best_eval_loss": 2.19 * rng.gauss(1, 0.005),
            **{f"loss_at_step_{s}": (4 - s / 400) * rng.gauss(1, 0.005) for s in range(100, 1001, 100)},
            "rollbacks": 0.0,
        }
        out.append(
            RunSummary(
                run_id=f"bench-{i:06d}",
                baseline_key=KEYS[(i // 2) % len(KEYS)],
                git_sha=f"{i:040x}",
                fingerprint=fingerprint_id(parts),
                fingerprint_parts=parts,
                started_at=NOW - timedelta(days=60) + timedelta(seconds=60 * 86400 * i / n),
                ended_at=None,
                status="completed",
                metrics=metrics,
            )
        )
    return out


def time_check(sink: ClickHouseSink, run: RunSummary, repeats: int) -> list[float]:
    config = BaselineConfig()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        assert run.baseline_key is not None and run.started_at is not None
        candidates = sink.baselines.candidates(
            run.baseline_key, run.fingerprint, run.started_at, config.window_days
        )
        report = check_run(run, candidates, config)
        times.append(time.perf_counter() - started)
    assert report.history_size >= config.min_runs
    return times


def bench_check(n: int, repeats: int) -> dict:
    result = {}
    for label, count in (("full", n), ("tenth", n // 10)):
        with tempfile.TemporaryDirectory() as folder:
            sink = ClickHouseSink(f"chdb://{folder}/ch")
            sink.migrate()
            summaries = generated_summaries(count)
            started = time.perf_counter()
            for i in range(0, len(summaries), 1000):
                sink.writer.write_summaries(summaries[i : i + 1000])
            write_s = time.perf_counter() - started
            times = time_check(sink, summaries[-1], repeats)
            sink.close()
        result[label] = {
            "summaries": count,
            "write_s": round(write_s, 3),
            "check_median_ms": round(1000 * statistics.median(times), 2),
            "check_max_ms": round(1000 * max(times), 2),
        }
    result["ratio_full_over_tenth"] = round(
        result["full"]["check_median_ms"] / result["tenth"]["check_median_ms"], 2
    )
    return result


def step_stream(run_id: str, start: datetime, steps: int, modules: int, seed: int) -> list:
    from runwatch.contract.schema import MemoryStats, StepEvent

    rng = random.Random(seed)
    names = [f"layers.{i}" for i in range(modules)]
    events = []
    for step in range(steps):
        noise = math.exp(rng.gauss(0, 0.1))
        events.append(
            StepEvent(
                run_id=run_id,
                step=step,
                ts=start + timedelta(seconds=0.5 * step),
                loss=3 * math.exp(-step / 500) * noise,
                grad_norm=noise,
                step_time_s=0.5 * math.exp(rng.gauss(0, 0.02)),
                module_grad_norms={n: 0.1 * noise * math.exp(rng.gauss(0, 0.1)) for n in names},
                memory=MemoryStats(allocated=30_000_000_000 + rng.randrange(10**8), peak=31_000_000_000),
            )
        )
    return events


def bench_band(runs: int, steps: int, modules: int, repeats: int) -> dict:
    from runwatch.detectors.baselines.summary import RunSummarizer

    now = datetime.now(UTC)  # the telemetry table keeps 90 days
    parts = {"hardware": "bench"}
    with tempfile.TemporaryDirectory() as folder:
        sink = ClickHouseSink(f"chdb://{folder}/ch")
        sink.migrate()
        summaries = []
        for i in range(runs):
            events = step_stream(f"band-{i}", now - timedelta(days=runs - i), steps, modules, seed=i)
            sink.writer.write_events(events)
            summarizer = RunSummarizer(f"band-{i}")
            for event in events:
                summarizer.observe(event)
            summary = summarizer.summary().model_copy(
                update={
                    "baseline_key": "bench/band",
                    "fingerprint": fingerprint_id(parts),
                    "fingerprint_parts": parts,
                    "status": "completed",
                }
            )
            summaries.append(summary)
        sink.writer.write_summaries(summaries)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            band = sink.baselines.band("bench/band", fingerprint_id(parts), now, 30, runs)
            times.append(time.perf_counter() - started)
        sink.close()
    assert band is not None and band.n_runs == runs
    return {
        "baseline_runs": runs,
        "steps": steps,
        "modules": modules,
        "metrics": len(band.metrics),
        "load_median_s": round(statistics.median(times), 3),
        "load_max_s": round(max(times), 3),
    }


def bench_detector(events: int, modules: int) -> dict:
    """Per step event: the baseline detector with a band of 5 runs, against the whole monitor (every
    detector and the policy) on the same stream, both measured here."""
    from runwatch.detectors.baseline_trajectory import BaselineTrajectoryConfig, BaselineTrajectoryDetector
    from runwatch.detectors.baselines.band import band_from_runs
    from runwatch.detectors.config import RunwatchConfig
    from runwatch.detectors.engine.monitor import RunMonitor

    start = NOW - timedelta(days=1)
    history = [step_stream(f"h{i}", start, events, modules, seed=i) for i in range(5)]
    band = band_from_runs(history, baseline_key="bench", fingerprint="bench")
    stream = step_stream("live", start, events, modules, seed=99)
    detector = BaselineTrajectoryDetector(BaselineTrajectoryConfig())
    detector.set_band(band)
    started = time.perf_counter()
    for event in stream:
        detector.update(event, event.ts)
    per_event = (time.perf_counter() - started) / len(stream)
    monitor = RunMonitor("live", RunwatchConfig())
    started = time.perf_counter()
    for event in stream:
        monitor.observe(event)
    monitor_per_event = (time.perf_counter() - started) / len(stream)
    return {
        "events": len(stream),
        "modules": modules,
        "band_metrics": len(band.metrics),
        "detector_us_per_event": round(1e6 * per_event, 1),
        "monitor_us_per_event": round(1e6 * monitor_per_event, 1),
        "detector_share_of_monitor": round(per_event / monitor_per_event, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summaries", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--band-runs", type=int, default=20)
    parser.add_argument("--band-steps", type=int, default=1000)
    parser.add_argument("--modules", type=int, default=20)
    parser.add_argument("--events", type=int, default=2000)
    args = parser.parse_args()
    print(
        json.dumps(
            {
                "check": bench_check(args.summaries, args.repeats),
                "band_load": bench_band(
                    args.band_runs, args.band_steps, args.modules, max(3, args.repeats // 4)
                ),
                "detector": bench_detector(args.events, args.modules),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
