"""Malformed telemetry goes to runwatch.deadletter with a reason; the worker keeps going."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import orjson
import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import DeadLetter, decode_anomaly
from runwatch.producer import StepEvent
from tests.conftest import read_topic

pytestmark = pytest.mark.integration


def test_malformed_messages_are_deadlettered_and_processing_continues(broker, worker):
    run_id = f"dl-{uuid.uuid4().hex[:8]}"
    key = run_id.encode()
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
    head = {
        "schema_version": 1,
        "rank": 0,
        "ts": datetime.now(UTC).isoformat(),
        "kind": "step",
        "run_id": run_id,
    }
    bad = {
        "not-json": b"this is { not json",
        "missing-step": orjson.dumps({**head, "event_id": "m1", "loss": 1.0}),
        "wrong-type": orjson.dumps({**head, "event_id": "m2", "step": "eleven"}),
    }
    for raw in bad.values():
        producer.send(topics.TELEMETRY, key=key, value=raw)
    # A valid run after the garbage: 30 healthy steps, then NaN, which must still be detected.
    for step in range(1, 31):
        producer.send(
            topics.TELEMETRY,
            key=key,
            value=StepEvent(run_id=run_id, step=step, loss=1.0, grad_norm=1.0).to_json(),
        )
    producer.send(
        topics.TELEMETRY, key=key, value=StepEvent(run_id=run_id, step=31, loss=float("nan")).to_json()
    )
    producer.flush()
    producer.close()

    def ours(records):
        return [DeadLetter.model_validate_json(r.value) for r in records if r.key == key]

    letters = ours(read_topic(broker.bootstrap, topics.DEADLETTER, lambda rs: len(ours(rs)) >= 3))
    reasons = sorted(d.reason for d in letters)
    assert len(letters) == 3
    assert any(r.startswith("not JSON") for r in reasons)
    assert any("step" in r and "Field required" in r for r in reasons)
    assert any("step" in r and "integer" in r for r in reasons)
    assert {d.raw for d in letters} == {raw.decode() for raw in bad.values()}

    def found(records):
        return [
            a
            for a in (decode_anomaly(r.value) for r in records if r.key == key)
            if a.detector == "non_finite"
        ]

    anomalies = found(read_topic(broker.bootstrap, topics.ANOMALIES, lambda rs: bool(found(rs))))
    assert anomalies[0].step == 31
