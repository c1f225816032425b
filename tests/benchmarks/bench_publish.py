"""Median wall time of one RunWatch.step() call, with and without a reachable broker.

Both cases run in one process against the same event shape; prints JSON. Not part of
the test suite (timings on shared machines are figures to read, not assertions).

    .venv/bin/python tests/benchmarks/bench_publish.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port
from runwatch.producer import RunWatch


def time_calls(rw: RunWatch, calls: int) -> list[float]:
    samples = []
    modules = {f"layer{i}": 0.1 * i for i in range(20)}
    for step in range(calls):
        t = time.perf_counter()
        rw.step(step, loss=1.0 / (step + 1), lr=[1e-3], grad_norm=0.5, module_grad_norms=modules)
        samples.append(time.perf_counter() - t)
        if step % 50 == 0:
            time.sleep(0.002)  # let the drain thread keep up, as a real step's compute would
    return samples


def summarize(samples: list[float]) -> dict:
    s = sorted(samples)
    return {
        "median_us": round(statistics.median(s) * 1e6, 2),
        "p99_us": round(s[int(0.99 * len(s))] * 1e6, 2),
        "max_us": round(s[-1] * 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    with EmbeddedBroker() as broker:
        ensure_topics(broker.bootstrap)
        up = RunWatch("bench-up", broker.bootstrap)
        reachable = time_calls(up, args.calls)
        up_stats = up.close(timeout=30)
    with tempfile.TemporaryDirectory() as spool_dir:  # with no broker, events go to the disk spool
        down = RunWatch("bench-down", f"127.0.0.1:{free_port()}", spool_dir=spool_dir)
        unreachable = time_calls(down, args.calls)
        down_stats = down.close(timeout=1)
    result = {
        "benchmark": "publish_call",
        "calls": args.calls,
        "reachable_broker": {
            **summarize(reachable),
            "published": up_stats.published,
            "dropped": up_stats.dropped,
        },
        "no_broker": {
            **summarize(unreachable),
            "published": down_stats.published,
            "dropped": down_stats.dropped,
            "spooled": down_stats.spooled,
        },
    }
    result["ratio_median_no_broker_over_reachable"] = round(
        result["no_broker"]["median_us"] / result["reachable_broker"]["median_us"], 3
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
