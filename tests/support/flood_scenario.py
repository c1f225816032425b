"""Issue 35, item 8: one run floods its partition while another run on the same partition (the victim)
hits a NaN streak. How long after the victim's NaN does its rollback reach the action topic?

Shared by tests/worker/test_partition_flood.py (that the victim is rolled back and the flood is shed
and reported) and tests/benchmarks/bench_flood.py (the delay, with the budget on and off). Real parts:
the embedded Tansu broker, a ``runwatch worker`` process, kafka-python clients.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import yaml
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from runwatch.contract import topics
from runwatch.contract.schema import CheckpointEvent, RunStartEvent, StepEvent, decode_action
from runwatch.contract.signing import ActionSigningKey
from runwatch.local.worker_process import WorkerProcess

_STEP_MARK = 987_654_321  # replaced by each flood event's step in its JSON


@dataclass
class FloodOutcome:
    victim: str
    flood: str
    partition: int
    flood_events: int
    flood_send_s: float
    delay_s: float | None  # the victim's last NaN sent -> its rollback on the action topic; None: none came
    rollback_kinds: list[str]
    counters: dict


def same_partition_key(victim: str, partitions: int, tag: str) -> str:
    want = topics.key_partition(victim.encode(), partitions)
    for i in range(10_000):
        candidate = f"flood-{tag}-{i}"
        if topics.key_partition(candidate.encode(), partitions) == want:
            return candidate
    raise AssertionError("no key on the victim's partition")


class _ActionWatch(threading.Thread):
    """Polls the action topic from its current end; notes when each of ``run_id``'s actions arrives."""

    def __init__(self, bootstrap: str, run_id: str):
        super().__init__(daemon=True)
        self.run_id = run_id.encode()
        self.arrivals: list[tuple[float, str]] = []
        self.stop = threading.Event()
        self.consumer = KafkaConsumer(
            bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, fetch_max_wait_ms=20
        )
        tps = [
            TopicPartition(topics.ACTIONS, p)
            for p in sorted(self.consumer.partitions_for_topic(topics.ACTIONS))
        ]
        self.consumer.assign(tps)
        self.consumer.seek_to_end()
        for tp in tps:
            self.consumer.position(tp)  # (resolve the end now, before anything is sent)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for batch in self.consumer.poll(timeout_ms=20).values():
                    for record in batch:
                        if record.key == self.run_id:
                            self.arrivals.append((time.monotonic(), decode_action(record.value).kind))
        finally:
            self.consumer.close()


def run_flood(
    bootstrap: str,
    signing_key: ActionSigningKey,
    folder: Path,
    config: dict,
    flood_events: int,
    timeout_s: float = 180.0,
) -> FloodOutcome:
    tag = uuid.uuid4().hex[:8]
    victim = f"victim-{tag}"
    probe = KafkaConsumer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    partitions = len(probe.partitions_for_topic(topics.TELEMETRY) or [])
    probe.close()
    flood = same_partition_key(victim, partitions, tag)
    config_path = folder / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    worker = WorkerProcess(bootstrap, signing_key, folder / "worker.log", config_path, group=f"flood-{tag}")
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, linger_ms=20, batch_size=512 * 1024
    )
    watch = _ActionWatch(bootstrap, victim)
    t0 = datetime.now(UTC) - timedelta(minutes=5)
    try:
        worker.wait_ready(90)
        watch.start()

        def step(n: int, loss: float) -> None:
            event = StepEvent(run_id=victim, step=n, loss=loss, grad_norm=1.0, ts=t0 + timedelta(seconds=n))
            producer.send(topics.TELEMETRY, key=victim.encode(), value=event.to_json())

        producer.send(
            topics.TELEMETRY, key=victim.encode(), value=RunStartEvent(run_id=victim, ts=t0).to_json()
        )
        for n in range(1, 31):  # a checkpoint at step 5, confirmed good by the steps after it
            step(n, 1.0)
            if n == 5:
                ckpt = CheckpointEvent(run_id=victim, step=5, uri=f"/ckpt/{victim}/5.pt", ts=t0)
                producer.send(topics.TELEMETRY, key=victim.encode(), value=ckpt.to_json())
        producer.flush(30)
        deadline = time.monotonic() + 60
        while worker.health()[1]["counters"]["processed"] < 32:
            if time.monotonic() > deadline:
                raise AssertionError("the worker did not process the victim's first steps")
            time.sleep(0.1)

        template = StepEvent(run_id=flood, step=_STEP_MARK, loss=1.0, grad_norm=1.0, ts=t0).to_json()
        mark = str(_STEP_MARK).encode()
        started = time.monotonic()
        for n in range(flood_events):
            producer.send(
                topics.TELEMETRY, key=flood.encode(), value=template.replace(mark, str(n + 1).encode())
            )
        producer.flush(120)
        flood_send_s = time.monotonic() - started

        for n in range(31, 34):
            step(n, math.nan)
        producer.flush(30)
        nan_sent = time.monotonic()
        deadline = nan_sent + timeout_s
        while time.monotonic() < deadline and not any(k in ("rollback", "stop") for _, k in watch.arrivals):
            time.sleep(0.02)
        acted = [at for at, kind in watch.arrivals if kind in ("rollback", "stop")]
        return FloodOutcome(
            victim=victim,
            flood=flood,
            partition=topics.key_partition(victim.encode(), partitions),
            flood_events=flood_events,
            flood_send_s=round(flood_send_s, 2),
            delay_s=round(acted[0] - nan_sent, 2) if acted else None,
            rollback_kinds=[kind for _, kind in watch.arrivals],
            counters=worker.health()[1]["counters"],
        )
    finally:
        watch.stop.set()
        if watch.is_alive():
            watch.join(5)
        producer.close(5)
        worker.stop()
