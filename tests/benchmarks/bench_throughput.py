"""Pipeline throughput: step events per second through one runwatch worker, against a no-op Faust
agent with the same settings reading the same events from the same broker, as a ratio in one run.

The telemetry topic is filled first (healthy step events of many runs, with 20 module norms, 8
categories, memory and timing fields), then each consumer group reads it from the start in its
own process; the clock runs from the group's partition assignment to its committed offsets
reaching the end (commits every 1 s, so each figure carries up to about 1 s of slack). Prints JSON.

    .venv/bin/python tests/benchmarks/bench_throughput.py [--events 40000]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import secrets
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from runwatch.producer import topics
from runwatch.producer.schema import CategoryLoss, MemoryStats, StepEvent
from runwatch.streams.app import DETECT_GROUP
from runwatch.streams.broker import EmbeddedBroker, committed_offset, ensure_topics, free_port
from runwatch.streams.demo import WorkerProcess

NOOP_GROUP = "runwatch-bench-noop"


def noop_worker(bootstrap: str, ready_file: str) -> None:
    """The baseline: a Faust agent on the telemetry topic that does nothing with the events."""
    from faust.worker import Worker

    from runwatch.streams.app import faust_app, mark_ready_on_assignment

    app = faust_app(bootstrap, NOOP_GROUP, web_port=free_port())
    telemetry = app.topic(topics.TELEMETRY, value_serializer="raw", key_serializer="raw")

    @app.agent(telemetry)
    async def drain(stream):  # noqa: ANN001
        async for _event in stream.events():
            pass

    mark_ready_on_assignment(app, Path(ready_file))
    Worker(app, loglevel="WARNING", quiet=True).execute_from_commandline()


def fill(bootstrap: str, n: int, runs: int) -> dict[int, int]:
    """Publish ``n`` step events over ``runs`` runs; returns the last offset per partition."""
    from kafka import KafkaProducer

    rng = random.Random(0)
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, acks=1,
                             linger_ms=20, batch_size=256 * 1024)
    last: dict[int, int] = {}
    t0 = datetime(2026, 11, 21, tzinfo=UTC)
    futures = []
    for i in range(n):
        run, step = f"bench-{i % runs}", i // runs
        event = StepEvent(
            run_id=run, step=step, ts=t0 + timedelta(seconds=0.2 * step),
            loss=2.0 * math.exp(rng.gauss(0, 0.05)), lr=[3e-4], grad_norm=1.0 + rng.random() * 0.1,
            module_grad_norms={f"layers.{k}": 0.1 + rng.random() * 0.01 for k in range(20)},
            category_loss={f"c{k}": CategoryLoss(mean=2.0 + rng.gauss(0, 0.05), count=16) for k in range(8)},
            step_time_s=0.2 * math.exp(rng.gauss(0, 0.05)), data_wait_s=0.01, samples_per_s=640.0,
            memory=MemoryStats(allocated=10**10, reserved=12 * 10**9, host_rss=8 * 2**30),
        )
        futures.append(producer.send(topics.TELEMETRY, key=run.encode(), value=event.to_json()))
    producer.flush(timeout=120)
    for f in futures:
        md = f.get(timeout=30)
        last[md.partition] = max(last.get(md.partition, -1), md.offset)
    producer.close()
    return last


def time_group(bootstrap: str, group: str, ready: Path, ends: dict[int, int], timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{group} did not get its partitions")
        time.sleep(0.02)
    started = time.monotonic()
    pending = dict(ends)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{group} did not finish: {pending}")
        for partition, end in list(pending.items()):
            if committed_offset(bootstrap, group, topics.TELEMETRY, partition) > end:
                del pending[partition]
        time.sleep(0.1)
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=40_000)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--noop-worker", nargs=2, metavar=("BOOTSTRAP", "READY_FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.noop_worker:
        noop_worker(*args.noop_worker)
        return
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(log_path=Path(tmp) / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        t = time.monotonic()
        ends = fill(broker.bootstrap, args.events, args.runs)
        fill_s = time.monotonic() - t

        ready = Path(tmp) / "noop.ready"
        noop = subprocess.Popen([sys.executable, __file__, "--noop-worker", broker.bootstrap, str(ready)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            noop_s = time_group(broker.bootstrap, NOOP_GROUP, ready, ends, args.timeout)
        finally:
            noop.terminate()
            noop.wait(30)

        worker = WorkerProcess(broker.bootstrap, secrets.token_hex(16), Path(tmp) / "worker.log")
        try:
            worker_s = time_group(broker.bootstrap, DETECT_GROUP, worker.ready_file, ends, args.timeout)
        finally:
            worker.stop()
    noop_rate, worker_rate = args.events / noop_s, args.events / worker_s
    print(json.dumps({
        "benchmark": "pipeline_throughput_step_events",
        "events": args.events,
        "runs": args.runs,
        "fill_events_per_s": round(args.events / fill_s),
        "noop_agent_events_per_s": round(noop_rate),
        "runwatch_worker_events_per_s": round(worker_rate),
        "ratio_worker_over_noop": round(worker_rate / noop_rate, 3),
        "target_ratio": 0.5,
    }, indent=2))


if __name__ == "__main__":
    main()
