"""Cost of every detector per step event: 100 module norms, 8 categories, memory and timing fields.

Feeds a healthy, noisy synthetic stream to one ``RunMonitor`` (all detectors on, the
action policy included) and prints JSON with the mean and percentiles of ``observe``
per step event, plus the cost of each detector alone. Not part of the test suite.

    .venv/bin/python tests/benchmarks/bench_detectors.py [--events 5000]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import CategoryLoss, MemoryStats, StepEvent
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import DETECTORS, RunMonitor

T0 = datetime(2026, 11, 21, tzinfo=UTC)


def stream(n: int, modules: int = 100, categories: int = 8, seed: int = 0) -> list[StepEvent]:
    rng = random.Random(seed)
    names = [f"layers.{i // 4}.{['attn', 'mlp.0', 'mlp.2', 'norm'][i % 4]}" for i in range(modules)]
    scale = {name: math.exp(rng.gauss(0, 1)) for name in names}
    events = []
    for step in range(n):
        noise = math.exp(rng.gauss(0, 0.2))
        module_norms = {name: scale[name] * noise * math.exp(rng.gauss(0, 0.1)) for name in names}
        events.append(
            StepEvent(
                run_id="bench",
                step=step,
                ts=T0 + timedelta(seconds=0.2 * step),
                loss=2.0 * math.exp(-step / 5000) * math.exp(rng.gauss(0, 0.05)),
                lr=[3e-4],
                grad_norm=math.sqrt(sum(v * v for v in module_norms.values())),
                module_grad_norms=module_norms,
                grad_norm_clipped=1.0,
                clip_ratio=0.5,
                nonfinite_grads=0,
                update_norm=1e-3 if step % 10 == 0 else None,
                param_norm=100.0 if step % 10 == 0 else None,
                relative_update_norm=1e-5 * math.exp(rng.gauss(0, 0.1)) if step % 10 == 0 else None,
                category_loss={
                    f"cat{c}": CategoryLoss(mean=2.0 + 0.1 * c + rng.gauss(0, 0.05), count=16)
                    for c in range(categories)
                },
                step_time_s=0.2 * math.exp(rng.gauss(0, 0.05)),
                data_wait_s=0.01,
                samples_per_s=640.0,
                memory=MemoryStats(
                    allocated=30_000_000_000 + rng.randrange(10**8),
                    reserved=34_000_000_000,
                    peak=31_000_000_000,
                    host_rss=8 * 2**30,
                    device_total=80 * 2**30,
                ),
            )
        )
    return events


def time_monitor(events: list[StepEvent], config: RunwatchConfig) -> list[float]:
    monitor = RunMonitor("bench", config)
    times = []
    for event in events:
        t = time.perf_counter()
        monitor.observe(event)
        times.append(time.perf_counter() - t)
    return times


def only(config: RunwatchConfig, name: str) -> RunwatchConfig:
    sections = {
        n: getattr(config.detectors, n).model_copy(update={"enabled": n == name})
        for n in type(config.detectors).model_fields
    }
    return config.model_copy(update={"detectors": type(config.detectors)(**sections)})


def summary_us(times: list[float], skip: int) -> dict:
    t = sorted(times[skip:])
    return {
        "mean_us": round(statistics.fmean(t) * 1e6, 1),
        "p50_us": round(t[len(t) // 2] * 1e6, 1),
        "p99_us": round(t[int(0.99 * len(t))] * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=5000)
    args = ap.parse_args()
    events = stream(args.events)
    skip = min(500, args.events // 5)  # past every warm-up
    config = RunwatchConfig()
    result = {
        "benchmark": "detectors_per_step_event",
        "events": args.events,
        "module_norms": 100,
        "categories": 8,
        "detectors": list(DETECTORS),
        "all_detectors": summary_us(time_monitor(events, config), skip),
        "target_us": 60,  # issue 27
    }
    result["per_detector_mean_us"] = {
        name: summary_us(time_monitor(events, only(config, name)), skip)["mean_us"] for name in DETECTORS
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
