"""The sink stores what is on the topics exactly once in the real embedded ClickHouse,
even when Kafka delivers duplicates, and its migrations are versioned and re-runnable."""

from __future__ import annotations

import threading
import uuid

import pytest
from kafka import KafkaProducer

from runwatch.producer import StepEvent, topics
from runwatch.sinks import ClickHouseSink, SinkConsumer
from runwatch.sinks.migrations import LATEST_VERSION

from .conftest import eventually

pytestmark = pytest.mark.integration


def test_duplicated_deliveries_are_stored_once(broker, chdb_dsn):
    sink = ClickHouseSink(chdb_dsn)
    try:
        sink.migrate()
        assert sink.migrate() == []  # nothing applied twice
        assert sink.schema_version() == LATEST_VERSION
        run_id = f"sink-{uuid.uuid4().hex[:8]}"
        events = [StepEvent(run_id=run_id, step=i, loss=float("nan") if i == 7 else 1.0 / i) for i in range(1, 51)]
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
        for _ in range(2):  # at-least-once: everything arrives twice
            for e in events:
                producer.send(topics.TELEMETRY, key=run_id.encode(), value=e.to_json())
        producer.send(topics.TELEMETRY, key=run_id.encode(), value=b"garbage")
        producer.flush()
        producer.close()

        consumer = SinkConsumer(sink, broker.bootstrap, group_id=f"sink-test-{run_id}", batch_interval_s=0.2)
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        try:
            eventually(lambda: consumer.stats.rows["telemetry"] >= 50, 60, "the sink to store the run")
            eventually(lambda: consumer.stats.skipped[topics.TELEMETRY] >= 1, 10, "the garbage to be skipped")
        finally:
            consumer.stopping.set()
            thread.join(30)
        assert sink.run_counts(run_id)["telemetry"] == 50
        rows = sink.query("SELECT step, loss FROM {db}.telemetry FINAL WHERE run_id = %(r)s ORDER BY step", {"r": run_id})
        assert [r[0] for r in rows] == list(range(1, 51))
        assert rows[6][1] != rows[6][1]  # the NaN loss is stored as NaN, not null or zero
    finally:
        sink.close()
