"""What a Prometheus scrape every second costs the worker: bench_latency.py's detection latency (a NaN step
published by the trainer to the signed alert reaching its ActionListener), measured against one
`runwatch worker --metrics-port` in blocks that alternate between no scraper and a scraper that GETs
/metrics every second (ABBA order, so that drift over the run falls on both). Prints JSON: the p50 of each,
their ratio, and what a scrape took.

The worker first holds ``--held-runs`` runs of ``--held-ranks`` ranks each (their steps published raw),
so that each scrape has that many ``runwatch_last_step_timestamp_seconds`` series to write.

    .venv/bin/python tests/benchmarks/bench_metrics_scrape.py [--blocks 8 --runs-per-block 10]
    .venv/bin/python tests/benchmarks/bench_metrics_scrape.py --held-runs 100 --held-ranks 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from runwatch.contract import topics
from runwatch.contract.schema import StepEvent
from runwatch.contract.signing import ActionSigningKey
from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port
from runwatch.local.worker_process import WorkerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_latency import one_run  # (the same measurement, run by run)


def hold_runs(bootstrap: str, runs: int, ranks: int) -> None:
    """One step per rank of ``runs`` runs, left running (no run_end): the worker holds them."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, linger_ms=20)
    now = datetime.now(UTC)
    for i in range(runs):
        run = f"held-{i}"
        for rank in range(ranks):
            world = {"world_size": ranks} if ranks > 1 else {}
            event = StepEvent(run_id=run, rank=rank, step=0, ts=now, loss=1.0, **world)
            producer.send(topics.TELEMETRY, key=run.encode(), value=event.to_json())
    producer.flush(timeout=120)
    producer.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


class Scraper(threading.Thread):
    """GET /metrics every ``every_s`` while ``on`` is set (Prometheus's scrape_interval: 1s)."""

    def __init__(self, port: int, every_s: float = 1.0):
        super().__init__(daemon=True, name="scraper")
        self.port, self.every_s = port, every_s
        self.on, self.stop = threading.Event(), threading.Event()
        self.took_s: list[float] = []
        self.size = 0

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.on.wait(0.1):
                continue
            started = time.perf_counter()
            self.size = len(scrape(self.port))
            self.took_s.append(time.perf_counter() - started)
            self.stop.wait(max(0.0, self.every_s - (time.perf_counter() - started)))


def pct(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 2) if ordered else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=8, help="blocks in all, half of them scraped (ABBA...)")
    ap.add_argument("--runs-per-block", type=int, default=10)
    ap.add_argument("--held-runs", type=int, default=1000)
    ap.add_argument("--held-ranks", type=int, default=1)
    ap.add_argument("--warmup-steps", type=int, default=25)
    ap.add_argument("--warmup-runs", type=int, default=5, help="measured first and left out (no scraper)")
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args()
    keys = ActionSigningKey.generate()
    latencies: dict[str, list[float]] = {"unscraped": [], "scraped": []}
    missed = {"unscraped": 0, "scraped": 0}
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(log_path=Path(tmp) / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        worker = WorkerProcess(
            broker.bootstrap, keys, Path(tmp) / "worker.log", extra_args=("--metrics-port", str(port))
        )
        scraper = Scraper(port)
        try:
            worker.wait_ready(90)
            hold_runs(broker.bootstrap, args.held_runs, args.held_ranks)
            deadline = time.monotonic() + 120
            while True:  # (the runs held, and their last steps: handed over on a tick, once a second)
                text = scrape(port)
                series = text.count("\nrunwatch_last_step_timestamp_seconds{")
                if series >= args.held_runs * min(args.held_ranks, 64):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the worker holds {series} series of the held runs after 120 s")
                time.sleep(0.5)
            scraper.start()
            index = 0
            for _ in range(args.warmup_runs):  # (the held runs' first ticks and joins are behind us after)
                one_run(broker.bootstrap, keys.public.text, index, args.warmup_steps, args.timeout)
                index += 1
            for block in range(args.blocks):
                mode = "scraped" if block % 4 in (1, 2) else "unscraped"  # ABBA ABBA ...
                if mode == "scraped":
                    scraper.on.set()
                    time.sleep(1.0)  # (its first scrape is under way before the block measures)
                else:
                    scraper.on.clear()
                for _ in range(args.runs_per_block):
                    latency = one_run(
                        broker.bootstrap, keys.public.text, index, args.warmup_steps, args.timeout
                    )
                    index += 1
                    if latency is None:
                        missed[mode] += 1
                    else:
                        latencies[mode].append(latency)
        finally:
            scraper.stop.set()
            worker.stop()
    p50 = {mode: pct(values, 0.5) for mode, values in latencies.items()}
    ratio = round(p50["scraped"] / p50["unscraped"], 3) if p50["scraped"] and p50["unscraped"] else None
    print(
        json.dumps(
            {
                "benchmark": "detection_latency_with_and_without_a_scrape_every_second",
                "held_runs": args.held_runs,
                "held_ranks": args.held_ranks,
                "last_step_series": series,
                "runs": {mode: len(values) for mode, values in latencies.items()},
                "missed": missed,
                "p50_ms": p50,
                "p99_ms": {mode: pct(values, 0.99) for mode, values in latencies.items()},
                "mean_ms": {
                    mode: round(statistics.fmean(values) * 1e3, 2) if values else None
                    for mode, values in latencies.items()
                },
                "p50_ratio_scraped_over_unscraped": ratio,
                "scrapes": len(scraper.took_s),
                "scrape_p50_ms": pct(scraper.took_s, 0.5),
                "scrape_max_ms": pct(scraper.took_s, 1.0),
                "scrape_bytes": scraper.size,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
