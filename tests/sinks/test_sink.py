"""The sink stores what is on the topics exactly once in the real embedded ClickHouse,
even when Kafka delivers duplicates, and its migrations are versioned and re-runnable."""

from __future__ import annotations

import threading
import uuid

import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.producer import StepEvent
from runwatch.sinks import ClickHouseSink, SinkConsumer
from runwatch.sinks.migrations import LATEST_VERSION
from tests.conftest import eventually

pytestmark = pytest.mark.integration


def test_duplicated_deliveries_are_stored_once(chdb_dsn, tmp_path):
    # A broker of its own: the waits below count rows and skips, and on the session's broker other
    # tests' telemetry (garbage included) met them before this run's records were read (a loaded CI run)
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        _store_twice_delivered_run(broker, chdb_dsn)


def _store_twice_delivered_run(broker: EmbeddedBroker, chdb_dsn: str) -> None:
    sink = ClickHouseSink(chdb_dsn)
    try:
        sink.migrate()
        assert sink.migrate() == []  # nothing applied twice
        assert sink.schema_version() == LATEST_VERSION
        run_id = f"sink-{uuid.uuid4().hex[:8]}"
        events = [
            StepEvent(run_id=run_id, step=i, loss=float("nan") if i == 7 else 1.0 / i) for i in range(1, 51)
        ]
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
            # the garbage was sent last, after both copies of the run: once it is skipped, all was read
            eventually(lambda: consumer.stats.skipped[topics.TELEMETRY] >= 1, 60, "the garbage to be skipped")
            eventually(lambda: consumer.stats.rows["telemetry"] >= 50, 10, "the sink to store the run")
        finally:
            consumer.stopping.set()
            thread.join(30)
        assert sink.runs.counts(run_id)["telemetry"] == 50
        rows = sink.query(
            "SELECT step, loss FROM {db}.telemetry FINAL WHERE run_id = %(r)s ORDER BY step", {"r": run_id}
        )
        assert [r[0] for r in rows] == list(range(1, 51))
        assert rows[6][1] != rows[6][1]  # the NaN loss is stored as NaN, not null or zero
    finally:
        sink.close()


def test_joined_steps_are_stored_once_per_run_generation_and_step(chdb_dsn):
    from datetime import UTC, datetime

    from runwatch.contract.schema import JoinedStep

    sink = ClickHouseSink(chdb_dsn)
    try:
        sink.migrate()
        run_id = f"joined-{uuid.uuid4().hex[:8]}"
        rows = [
            JoinedStep(
                run_id=run_id,
                step=s,
                generation=g,
                ts=datetime.now(UTC),
                world_size=3,
                complete=s != 4,
                ranks_reported=[0, 1] if s == 4 else [0, 1, 2],
                ranks_missing=[2] if s == 4 else [],
                grad_norm=float(s),
                step_time_max_s=0.5,
                step_time_max_rank=2,
            )
            for g in (0, 1)
            for s in range(5)
        ]
        assert sink.writer.write_joined(rows + rows[:3]) == 10  # a redelivered batch adds nothing
        sink.writer.write_joined(rows[:3])
        got = sink.query(
            "SELECT generation, step, complete, ranks_missing, step_time_max_rank FROM "
            "{db}.joined_steps FINAL WHERE run_id = %(r)s ORDER BY generation, step",
            {"r": run_id},
        )
        assert len(got) == 10
        assert got[4] == (0, 4, False, [2], 2) and got[5][:3] == (1, 0, True)
    finally:
        sink.close()


def test_an_anomaly_keeps_its_onset_step_and_the_report_shows_it(chdb_dsn):
    from datetime import UTC, datetime

    from runwatch.contract.schema import Anomaly

    sink = ClickHouseSink(chdb_dsn)
    try:
        sink.migrate()
        run_id = f"onset-{uuid.uuid4().hex[:8]}"
        found = [
            Anomaly(
                anomaly_id=f"{run_id}-{i}",
                run_id=run_id,
                step=step,
                onset_step=onset,
                detector="memory_growth",
                metric="host_rss",
                severity="warning",
                message="leak",
                ts=datetime.now(UTC),
            )
            for i, (step, onset) in enumerate([(140, 121), (200, None)])
        ]
        assert sink.writer.write_anomalies(found) == 2
        assert [(a["step"], a["onset_step"]) for a in sink.report.anomalies(run_id)] == [
            (140, 121),
            (200, None),
        ]
    finally:
        sink.close()


def test_the_stored_payload_is_the_bytes_received(broker, chdb_dsn):
    """Not a re-serialisation: whitespace, key order, number spelling, escapes and unicode survive."""
    from datetime import UTC, datetime

    from runwatch.local.broker import committed_offset

    run_id = f"payload-{uuid.uuid4().hex[:8]}"
    ts = datetime.now(UTC).isoformat()
    raws = [
        (
            f'{{ "ts" : "{ts}",\n  "kind":"step",   "step" : 7, "loss": 1.50e0, "rank":0,\n'
            f'  "run_id": "{run_id}", "schema_version": 1, "event_id": "ev-{run_id}-1",\n'
            '  "note": "caf\\u00e9 \u2603 \U0001f525 \u00fcber", "nested": {"b": 1, "a": [1.0, 2.00]} }\n'
        ).encode(),
        f'{{"event_id":"ev-{run_id}-2","run_id":"{run_id}","schema_version":1,"rank":0,"ts":"{ts}",'
        f'"kind":"heartbeat","phase":"idle","step":7,"\u540d\u524d":"\u30c6\u30b9\u30c8"}}'.encode(),
    ]
    sink = ClickHouseSink(chdb_dsn)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
    try:
        sink.migrate()
        sent = [
            producer.send(topics.TELEMETRY, key=run_id.encode(), value=raw).get(timeout=30) for raw in raws
        ]
        producer.flush()
        group = f"sink-payload-{run_id}"
        consumer = SinkConsumer(sink, broker.bootstrap, group_id=group, batch_interval_s=0.2)
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        try:
            eventually(
                lambda: sink.runs.counts(run_id)["telemetry"] == 2, 60, "the sink to store both events"
            )
            eventually(
                lambda: (
                    committed_offset(broker.bootstrap, group, topics.TELEMETRY, sent[-1].partition)
                    > sent[-1].offset
                ),
                30,
                "the commit",
            )
        finally:
            consumer.stopping.set()
            thread.join(30)
        rows = sink.query(
            "SELECT event_id, payload FROM {db}.telemetry FINAL WHERE run_id = %(r)s ORDER BY event_id",
            {"r": run_id},
        )
        assert [payload.encode() for _, payload in rows] == raws
    finally:
        producer.close()
        sink.close()
