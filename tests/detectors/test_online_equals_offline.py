"""Online equals offline: one recorded scenario through the live Faust worker (real broker) and
through `runwatch replay` gives the same findings, down to the anomaly ids."""

from __future__ import annotations

import time
import uuid

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import decode_anomaly
from runwatch.detectors.offline.replay import read_events, replay
from runwatch.scenarios.corpus import generate
from tests.conftest import read_topic

pytestmark = pytest.mark.integration

SCENARIO = "module_explosion_mlp"  # a module explosion and the grad-norm spikes that follow it


def test_a_recorded_scenario_gives_the_same_findings_online_and_offline(broker, worker, tmp_path):
    generate(tmp_path, [SCENARIO])
    run_id = f"online-offline-{uuid.uuid4().hex[:8]}"
    events = [e.model_copy(update={"run_id": run_id}) for e in read_events(tmp_path / f"{SCENARIO}.jsonl")]

    offline = replay(events)
    expected = {(a.anomaly_id, a.detector, a.step, a.severity) for a in offline.anomalies}
    assert {a.detector for a in offline.anomalies} >= {"module_grad_explosion", "grad_norm_spike"}

    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION, acks=1)
    try:
        for event in events:  # one key: one partition, so the worker sees the recorded order
            # a recording replayed keeps its timestamps: the record's is the event's (docs/wire-format.md)
            producer.send(
                topics.TELEMETRY,
                key=run_id.encode(),
                value=event.to_json(),
                timestamp_ms=int(event.ts.timestamp() * 1000),
            )
        producer.flush(timeout=30)
    finally:
        producer.close()

    def ours(records):
        return {
            (a.anomaly_id, a.detector, a.step, a.severity)
            for a in (decode_anomaly(r.value) for r in records)
            if a.run_id == run_id
        }

    # read from the start until the run's findings are all there (or time out failing)
    read_topic(broker.bootstrap, topics.ANOMALIES, lambda r: len(ours(r)) >= len(expected), timeout=60)
    time.sleep(2.0)  # anything extra the worker would add has had time to arrive
    online = ours(read_topic(broker.bootstrap, topics.ANOMALIES, lambda r: len(ours(r)) >= len(expected)))
    assert online == expected
