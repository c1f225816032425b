"""Detection time (issue 12): the live worker stamps each anomaly with its own clock (``detected_at``)
next to the step's event time (``ts``), the sink stores both in ClickHouse, and the detection
latency is a query (docs/sink.md)."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import decode_anomaly
from runwatch.producer import RunWatch
from runwatch.sinks import ClickHouseSink, SinkConsumer
from runwatch.sinks.migrations import LATEST_VERSION
from tests.conftest import eventually, read_topic

pytestmark = pytest.mark.integration

# The query docs/sink.md gives for the detection latency, per detector.
LATENCY_SQL = """
SELECT detector, count() AS n,
       min(dateDiff('millisecond', ts, detected_at)) AS min_ms,
       max(dateDiff('millisecond', ts, detected_at)) AS max_ms
FROM {db}.anomalies FINAL
WHERE run_id = %(run)s AND detected_at IS NOT NULL
GROUP BY detector
"""


def test_detected_at_is_stored_and_latency_is_a_query(broker, worker, chdb_dsn):
    run_id = f"latency-{uuid.uuid4().hex[:8]}"
    started = datetime.now(UTC)
    rw = RunWatch(run_id, broker.bootstrap)
    try:
        for step in range(12):
            rw.step(step, loss=float("nan") if step >= 8 else 1.0 / (step + 1), step_time_s=0.01)
            time.sleep(0.01)
    finally:
        rw.close()

    key = run_id.encode()
    records = read_topic(
        broker.bootstrap, topics.ANOMALIES, lambda rs: any(r.key == key for r in rs), timeout=60
    )
    ours = [decode_anomaly(r.value) for r in records if r.key == key]
    assert ours and all(a.detected_at is not None for a in ours)
    for a in ours:  # the worker's clock at detection, after the step's event time and before now
        assert a.ts <= a.detected_at <= datetime.now(UTC)
        assert a.ts >= started

    sink = ClickHouseSink(chdb_dsn)
    try:
        sink.migrate()
        assert sink.schema_version() == LATEST_VERSION >= 5
        consumer = SinkConsumer(
            sink, broker.bootstrap, group_id=f"sink-latency-{run_id}", batch_interval_s=0.2
        )
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        try:
            eventually(
                lambda: sink.runs.counts(run_id)["anomalies"] >= len({a.anomaly_id for a in ours}),
                60,
                "the sink to store the run's anomalies",
            )
        finally:
            consumer.stopping.set()
            thread.join(30)
        rows = sink.query(
            "SELECT anomaly_id, ts, detected_at FROM {db}.anomalies FINAL WHERE run_id = %(run)s",
            {"run": run_id},
        )
        stored = {r[0]: r for r in rows}
        for a in ours:
            _, ts, detected_at = stored[a.anomaly_id]
            assert detected_at is not None
            # (ms precision)
            assert abs((detected_at.replace(tzinfo=UTC) - a.detected_at).total_seconds()) < 0.002
        latency = sink.query(LATENCY_SQL, {"run": run_id})
        print(f"\ndetection latency (detector, n, min ms, max ms): {latency}")
        assert latency and {r[0] for r in latency} == {a.detector for a in ours}
        for detector, n, min_ms, max_ms in latency:
            assert n >= 1
            assert 0 <= min_ms <= max_ms < 30_000, (detector, min_ms, max_ms)  # non-negative, and small
    finally:
        sink.close()
