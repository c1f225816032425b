"""A store that answers but cannot store (issue 35, item 5): a ClickHouse switched to read-only, or out
of disk, refuses every insert while `SELECT 1` still works. The sink must tell that from a bad row: it
stops, retries the batch with backoff and says so, and dead-letters nothing; once the store takes inserts
again every row is there. Real broker, real embedded ClickHouse (a session of its own made read-only, as a
read-only profile or user would make it), 20,000 events at 1,000 a second with the store read-only for
7 s of them."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import clickhouse_connect
import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.producer import StepEvent
from runwatch.sinks import ClickHouseSink, SinkConsumer
from tests.conftest import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EVENTS = 20_000
RATE = 1_000  # events a second
READ_ONLY_S = 7.0


@pytest.fixture
def own_broker(tmp_path) -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as b:
        ensure_topics(b.bootstrap)
        yield b


def _publish(bootstrap: str, run_id: str, done: threading.Event) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, linger_ms=5)
    key = run_id.encode()
    started = time.monotonic()
    try:
        for step in range(EVENTS):
            producer.send(
                topics.TELEMETRY, key=key, value=StepEvent(run_id=run_id, step=step, loss=1.0).to_json()
            )
            lag = started + step / RATE - time.monotonic()
            if lag > 0:
                time.sleep(lag)
        producer.flush(60)
    finally:
        producer.close()
        done.set()


def test_a_read_only_store_for_7_s_loses_no_row_and_dead_letters_none(own_broker, tmp_path, caplog):
    run_id = f"readonly-{uuid.uuid4().hex[:8]}"
    sink = ClickHouseSink(f"chdb://{tmp_path / 'store'}")
    sink.migrate()
    consumer = SinkConsumer(sink, own_broker.bootstrap, group_id=f"sink-{run_id}", batch_interval_s=0.2)
    thread = threading.Thread(target=consumer.run, daemon=True)
    published = threading.Event()
    publisher = threading.Thread(target=_publish, args=(own_broker.bootstrap, run_id, published), daemon=True)
    thread.start()
    try:
        eventually(consumer.assigned.is_set, 60, "the sink's partitions")
        publisher.start()
        eventually(lambda: consumer.stats.rows["telemetry"] >= 2 * RATE, 60, "the first rows stored")
        # the store turns read-only: every insert fails with READONLY (164), SELECT 1 answers
        writable = sink.client
        read_only = clickhouse_connect.get_client(dsn=sink.dsn)
        read_only.set_client_setting("readonly", "1")
        sink.client = read_only
        try:
            time.sleep(READ_ONLY_S)
        finally:
            sink.client = writable
            read_only.close()
        assert published.wait(60), "the publisher did not finish"
        eventually(lambda: sink.runs.counts(run_id)["telemetry"] == EVENTS, 120, "every row stored")
    finally:
        consumer.stopping.set()
        thread.join(60)
        sink.close()
    assert consumer.stats.write_errors >= 1  # it did meet the read-only store, and retried
    assert not consumer.stats.deadlettered, consumer.stats.deadlettered
    assert "cannot store the batch" in caplog.text and "READONLY" in caplog.text
