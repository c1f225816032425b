"""The sink's consumer loop: its own consumer group, batches by size and time.

Offsets are committed only after a batch is in ClickHouse, so a crash or a
ClickHouse outage re-delivers rather than loses; the tables deduplicate on ids.
Detection never waits on this loop: it is a separate group on the same topics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from runwatch.producer import topics
from runwatch.producer.schema import (
    DeadLetter,
    JoinedStep,
    SchemaError,
    decode_action,
    decode_anomaly,
    decode_event,
)
from runwatch.sinks.clickhouse import ClickHouseSink

log = logging.getLogger(__name__)

SINK_GROUP = "runwatch-sink"


@dataclass
class SinkStats:
    rows: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    batches: int = 0
    write_errors: int = 0
    commit_errors: int = 0  # offset commits that failed (broker unreachable, rebalance); rows were stored
    last_empty_poll: float = 0.0  # monotonic time of the last poll that returned nothing


class SinkConsumer:
    def __init__(
        self,
        sink: ClickHouseSink,
        bootstrap: str,
        *,
        group_id: str = SINK_GROUP,
        batch_size: int = 2000,
        batch_interval_s: float = 0.5,
        session_timeout_ms: int = 6000,
        commit_timeout_ms: int = 5000,
    ):
        self.sink = sink
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.batch_size = batch_size
        self.batch_interval_s = batch_interval_s
        self.session_timeout_ms = session_timeout_ms
        self.commit_timeout_ms = commit_timeout_ms
        self.stats = SinkStats()
        self.positions: dict[tuple[str, int], int] = {}  # next offset after what is stored
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self.assigned = threading.Event()

    def stored_through(self, topic: str, partition: int) -> int:
        """Next offset of ``topic[partition]`` not yet stored (0 if none)."""
        with self._lock:
            return self.positions.get((topic, partition), 0)

    def _decode_batch(self, records: list) -> dict[str, list]:
        batch: dict[str, list] = {"telemetry": [], "anomalies": [], "actions": [], "deadletter": [], "joined": []}
        for r in records:
            try:
                if r.topic == topics.TELEMETRY:
                    batch["telemetry"].append(decode_event(r.value))
                elif r.topic == topics.ANOMALIES:
                    batch["anomalies"].append(decode_anomaly(r.value))
                elif r.topic == topics.ACTIONS:
                    batch["actions"].append(decode_action(r.value))
                elif r.topic == topics.DEADLETTER:
                    batch["deadletter"].append(DeadLetter.model_validate_json(r.value))
                elif r.topic == topics.JOINED:
                    batch["joined"].append(JoinedStep.model_validate_json(r.value))
            except (SchemaError, ValueError):
                # Malformed telemetry is the worker's to dead-letter; the sink just skips it.
                self.stats.skipped[r.topic] += 1
        return batch

    def _write(self, batch: dict[str, list]) -> None:
        self.stats.rows["telemetry"] += self.sink.write_events(batch["telemetry"])
        self.stats.rows["anomalies"] += self.sink.write_anomalies(batch["anomalies"])
        self.stats.rows["actions"] += self.sink.write_actions(batch["actions"])
        self.stats.rows["deadletter"] += self.sink.write_deadletters(batch["deadletter"])
        self.stats.rows["joined_steps"] += self.sink.write_joined(batch["joined"])

    def run(self) -> None:
        """Consume until ``stopping`` is set; flushes the last batch before returning."""
        from kafka import KafkaConsumer

        consumer = KafkaConsumer(
            *topics.ALL_TOPICS,
            bootstrap_servers=self.bootstrap,
            api_version=topics.KAFKA_API_VERSION,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=1000,
            client_id="runwatch-sink",
        )
        pending: list = []
        started = time.monotonic()
        try:
            while True:
                stopping = self.stopping.is_set()
                polled = consumer.poll(timeout_ms=100 if not stopping else 0, max_records=self.batch_size)
                if consumer.assignment():
                    self.assigned.set()
                got = [r for records in polled.values() for r in records]
                if not got:
                    self.stats.last_empty_poll = time.monotonic()
                pending.extend(got)
                due = time.monotonic() - started >= self.batch_interval_s
                if pending and (len(pending) >= self.batch_size or due or stopping):
                    self._flush(consumer, pending)
                    pending = []
                    started = time.monotonic()
                elif not pending:
                    started = time.monotonic()
                if stopping and not got and not pending:
                    break
        finally:
            consumer.close()

    def _flush(self, consumer, pending: list) -> None:
        batch = self._decode_batch(pending)
        delay = 0.5
        while True:
            try:
                self._write(batch)
                break
            except Exception as exc:  # ClickHouse down: keep the batch, retry, never commit past it
                self.stats.write_errors += 1
                log.warning("runwatch sink: ClickHouse write failed (%s); retrying in %.1fs", exc, delay)
                if self.stopping.wait(delay) and self.stats.write_errors > 20:
                    raise
                delay = min(delay * 2, 10.0)
        try:
            consumer.commit(timeout_ms=self.commit_timeout_ms)
        except Exception as exc:  # broker unreachable or group rebalanced: the rows are stored, and the
            # next commit covers these offsets too; at worst they are re-delivered and deduplicated
            self.stats.commit_errors += 1
            log.warning("runwatch sink: offset commit failed (%r); carrying on", exc)
        self.stats.batches += 1
        with self._lock:
            for r in pending:
                key = (r.topic, r.partition)
                if r.offset + 1 > self.positions.get(key, 0):
                    self.positions[key] = r.offset + 1
