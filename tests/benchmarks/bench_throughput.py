"""Pipeline throughput: step events per second through one runwatch worker, against a no-op Faust
agent with the same settings reading the same events from the same broker, as a ratio in one run.

The telemetry topic is filled first (healthy step events of many runs, with 20 module norms, 8
categories, memory and timing fields). Then each consumer reads all of it from the start in its
own process, as a fresh consumer group: the no-op agent, and the runwatch worker (the real
``create_app``: its agent, detector process and publishing). Each round runs both, alternating
which goes first. Each consumer times itself on its own clock, from its first event to the last
offset of every partition (for the worker: to the detector process's reply for it), so group
joins, start-up and commit intervals are outside the figures.
Prints JSON: every round's rates and ratio, and their medians.

    .venv/bin/python tests/benchmarks/bench_throughput.py [--events 40000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from state_bench_events import step_event as healthy_step

from runwatch.contract import topics
from runwatch.contract.schema import StepEvent
from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port


class FinishClock:
    """Called for every event with its partition and offset: notes when the first arrives and when
    every partition has reached its last offset, then writes the elapsed seconds to ``out``."""

    def __init__(self, ends: dict[int, int], out: Path):
        self.pending, self.out = dict(ends), out
        self.events, self.started = 0, None

    def begin(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def __call__(self, partition: int, offset: int) -> None:
        self.begin()
        self.events += 1
        end = self.pending.get(partition)
        if end is not None and offset >= end:
            del self.pending[partition]
            if not self.pending:
                elapsed = time.perf_counter() - self.started
                self.out.write_text(json.dumps({"seconds": elapsed, "events": self.events}))


def consumer(role: str, bootstrap: str, ends_json: str, out: str) -> None:
    """A consumer process: the no-op agent or the runwatch worker, with a FinishClock on its events."""
    from faust.worker import Worker

    from runwatch.detectors import RunwatchConfig
    from runwatch.worker.app import create_app, faust_app

    clock = FinishClock({int(p): end for p, end in json.loads(ends_json).items()}, Path(out))
    group = f"runwatch-bench-{role}-{secrets.token_hex(4)}"  # a fresh group reads from the start
    if role == "noop":
        app = faust_app(bootstrap, group, web_port=free_port())
        telemetry = app.topic(topics.TELEMETRY, value_serializer="raw", key_serializer="raw")

        @app.agent(telemetry)
        async def drain(stream):
            async for event in stream.events():
                clock(event.message.partition, event.message.offset)
    else:
        app, detectors = create_app(
            bootstrap, RunwatchConfig(), secrets.token_bytes(32), app_id=group, web_port=free_port()
        )
        submit = detectors.submit

        def timed_submit(kind, payload=None):  # an event counts once its reply is back
            reply = submit(kind, payload)
            if kind == "events":
                clock.begin()
                reply.add_done_callback(lambda _f: [clock(p, o) for _v, _k, p, o, _ts in payload])
            return reply

        detectors.submit = timed_submit
        detectors.wait_ready()  # (the child's start-up is not part of the figure)
    sys.argv = [sys.argv[0]]
    Worker(app, loglevel="WARNING", quiet=True).execute_from_commandline()


def step_event(rng: random.Random, i: int, runs: int, t0: datetime) -> StepEvent:
    """The ``i``-th healthy step event of ``runs`` runs (round robin): 20 module norms, 8 categories,
    memory and timing fields, as bench_state.py's. Also bench_processor_compare.py's events."""
    return healthy_step(f"bench-{i % runs}", i // runs, rng, t0)


def fill(bootstrap: str, n: int, runs: int) -> dict[int, int]:
    """Publish ``n`` step events over ``runs`` runs; returns the last offset per partition."""
    from kafka import KafkaProducer

    rng = random.Random(0)
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        acks=1,
        linger_ms=20,
        batch_size=256 * 1024,
    )
    last: dict[int, int] = {}
    t0 = datetime.now(UTC) - timedelta(hours=1)  # (ts must lie near the record timestamp: now)
    futures = []
    for i in range(n):
        run = f"bench-{i % runs}"
        event = step_event(rng, i, runs, t0)
        futures.append(producer.send(topics.TELEMETRY, key=run.encode(), value=event.to_json()))
    producer.flush(timeout=120)
    for f in futures:
        md = f.get(timeout=30)
        last[md.partition] = max(last.get(md.partition, -1), md.offset)
    producer.close()
    return last


def consume(role: str, bootstrap: str, ends: dict[int, int], tmp: Path, timeout: float) -> float:
    """Run one consumer process until it has timed itself; returns its seconds."""
    out = tmp / f"{role}.json"
    out.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--consumer", role, bootstrap, json.dumps(ends), str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while not out.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the {role} consumer exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {role} consumer did not finish within {timeout} s")
            time.sleep(0.1)
        time.sleep(0.05)  # (the file is written in one call; let it land)
        result = json.loads(out.read_text())
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if result["events"] < sum(end + 1 for end in ends.values()):
        raise RuntimeError(f"the {role} consumer saw {result['events']} events, fewer than published")
    return result["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=40_000)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument(
        "--consumer", nargs=4, metavar=("ROLE", "BOOTSTRAP", "ENDS", "OUT"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    # The worker's state is on, as in production: its snapshots need a secret (the children inherit it).
    os.environ.setdefault("RUNWATCH_STATE_SECRET", secrets.token_hex(32))
    if args.consumer:
        consumer(*args.consumer)
        return
    rounds = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(log_path=Path(tmp) / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        t = time.monotonic()
        ends = fill(broker.bootstrap, args.events, args.runs)
        fill_s = time.monotonic() - t
        for r in range(args.rounds):
            order = ("noop", "runwatch") if r % 2 == 0 else ("runwatch", "noop")
            seconds = {role: consume(role, broker.bootstrap, ends, Path(tmp), args.timeout) for role in order}
            noop_rate, worker_rate = args.events / seconds["noop"], args.events / seconds["runwatch"]
            rounds.append(
                {
                    "first": order[0],
                    "noop_agent_events_per_s": round(noop_rate),
                    "runwatch_worker_events_per_s": round(worker_rate),
                    "ratio_worker_over_noop": round(worker_rate / noop_rate, 3),
                }
            )
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "benchmark": "pipeline_throughput_step_events",
                "events": args.events,
                "runs": args.runs,
                "fill_events_per_s": round(args.events / fill_s),
                "rounds": rounds,
                "median_noop_agent_events_per_s": round(
                    statistics.median(r["noop_agent_events_per_s"] for r in rounds)
                ),
                "median_runwatch_worker_events_per_s": round(
                    statistics.median(r["runwatch_worker_events_per_s"] for r in rounds)
                ),
                "median_ratio_worker_over_noop": round(
                    statistics.median(r["ratio_worker_over_noop"] for r in rounds), 3
                ),
                "target_ratio": 0.5,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
