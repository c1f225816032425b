"""Issue 35, item 3: offsets belong to the log they came from. The embedded broker (Tansu) keeps
everything in memory: killed and started again on the same port, its topics come back empty (ensure_topics)
with new topic ids; a topic deleted and created again is the same on any broker. A worker that lives through
it must not resume the new log at the old log's offset (Faust drops every record below the offset it last
read, and Tansu answers a fetch past a log's end with nothing, so offsets 0..old-1 of the new log were never
judged), nor commit the old position on it (a successor then began there). Here the worker reads the new
log from its beginning, judges the NaN streak at its first offsets and rolls back to the checkpoint
confirmed before; what it commits on the new log lies within it; /health counts the recreated partitions
and the log says so. Without the fix the first case fails: no rollback, and the old position committed."""

from __future__ import annotations

import math
import os
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import CheckpointEvent, RunStartEvent, StepEvent, decode_action
from runwatch.local.broker import EmbeddedBroker, committed_offset, ensure_topics
from runwatch.local.worker_process import WorkerProcess
from tests.conftest import eventually, read_topic

pytestmark = pytest.mark.integration

GROUP = "runwatch-broker-restart"
BEFORE = 240  # healthy steps on the old log (a checkpoint at step 5, confirmed good 20 steps later)
NAN_STEPS = 3  # the new log starts with them (offsets 0-2), then healthy steps ...
AFTER = 20  # ... all of it far below the old log's end


def _producer(bootstrap: str) -> KafkaProducer:
    return KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, linger_ms=5)


def _kinds(bootstrap: str, run_id: str, until, timeout: float) -> list[str]:
    key = run_id.encode()

    def kinds(records):
        return [decode_action(r.value).kind for r in records if r.key == key]

    return kinds(read_topic(bootstrap, topics.ACTIONS, lambda rs: until(kinds(rs)), timeout))


def _restart_broker(broker: EmbeddedBroker, tmp_path: Path) -> EmbeddedBroker:
    """The broker dies (memory only) and a new one starts on the same port, its topics created empty."""
    assert broker.process is not None
    broker.process.send_signal(signal.SIGKILL)
    broker.process.wait(10)
    broker.process = None
    again = EmbeddedBroker(port=broker.port, log_path=tmp_path / "broker2.log").start()
    ensure_topics(again.bootstrap)
    return again


def _recreate_topic(broker: EmbeddedBroker, tmp_path: Path) -> EmbeddedBroker:
    """The telemetry topic deleted and created again on the same broker (its committed offsets go with it)."""
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
    try:
        admin.delete_topics([topics.TELEMETRY])
    finally:
        admin.close()
    time.sleep(1.0)
    ensure_topics(broker.bootstrap)
    return broker


@pytest.mark.parametrize(
    "recreate", [_restart_broker, _recreate_topic], ids=["broker_restart", "topic_recreated"]
)
def test_a_recreated_log_is_judged_from_its_first_offset_and_no_old_position_is_committed_on_it(
    tmp_path, action_keys, recreate
):
    run_id = f"restart-{uuid.uuid4().hex[:8]}"
    key = run_id.encode()
    t0 = datetime.now(UTC) - timedelta(minutes=10)
    broker = EmbeddedBroker(log_path=tmp_path / "broker.log").start()
    worker = None
    try:
        ensure_topics(broker.bootstrap)
        worker = WorkerProcess(broker.bootstrap, action_keys.signing, tmp_path / "worker.log", group=GROUP)
        worker.wait_ready(90)
        # The log goes mid-run: the worker has read the old one, and its detector process (held with
        # SIGSTOP) answers only once the new one is there, so that the worker acknowledges old-log
        # positions after the change and offers them to commit, as a worker busy at that moment does
        detector = worker.health()[1]["detector_process"]["pid"]
        os.kill(detector, signal.SIGSTOP)
        producer = _producer(broker.bootstrap)
        sent = [producer.send(topics.TELEMETRY, key=key, value=RunStartEvent(run_id=run_id, ts=t0).to_json())]
        for step in range(1, BEFORE + 1):
            ts = t0 + timedelta(seconds=step)
            event = StepEvent(run_id=run_id, step=step, loss=1.0, grad_norm=1.0, ts=ts)
            sent.append(producer.send(topics.TELEMETRY, key=key, value=event.to_json()))
            if step == 5:
                ckpt = CheckpointEvent(run_id=run_id, step=step, uri="/ckpt/5.pt", ts=ts)
                sent.append(producer.send(topics.TELEMETRY, key=key, value=ckpt.to_json()))
        producer.flush(30)
        producer.close(10)
        last = sent[-1].get(timeout=10)
        partition, old_end = last.partition, last.offset + 1
        time.sleep(1.0)  # (fetched and handed to the held detector process)

        broker = recreate(broker, tmp_path)
        os.kill(detector, signal.SIGCONT)
        time.sleep(2.0)  # (the old log's events answered and acknowledged: their positions offered to commit)

        # The run goes on in the new log: a NaN streak at its first offsets, then healthy steps
        producer = _producer(broker.bootstrap)
        sent = []
        for step in range(BEFORE + 1, BEFORE + NAN_STEPS + AFTER + 1):
            loss = math.nan if step <= BEFORE + NAN_STEPS else 1.0
            ts = t0 + timedelta(seconds=step)
            event = StepEvent(run_id=run_id, step=step, loss=loss, grad_norm=1.0, ts=ts)
            sent.append(producer.send(topics.TELEMETRY, key=key, value=event.to_json()))
        producer.flush(30)
        producer.close(10)
        assert sent[0].get(timeout=10).offset == 0
        new_last = sent[-1].get(timeout=10)
        assert new_last.partition == partition and new_last.offset + 1 < old_end
        new_end = new_last.offset + 1

        # every record of the new log judged: the NaN streak at offsets 0-2 rolls back to step 5's checkpoint
        kinds = _kinds(broker.bootstrap, run_id, lambda ks: "rollback" in ks or "stop" in ks, 90)
        assert kinds == ["alert", "rollback"], kinds
        # what it commits on the new log is a position of the new log, never the old one (old_end)
        eventually(
            lambda: committed_offset(broker.bootstrap, GROUP, topics.TELEMETRY, partition) == new_end,
            30,
            "the worker to commit the new log's end",
        )
        health = worker.health()[1]
        assert health["counters"]["logs_recreated"] >= 1, health["counters"]
        assert health["telemetry_topic_id"], health
        text = worker.log_path.read_text(errors="replace")
        assert f"{topics.TELEMETRY}[{partition}] was recreated" in text, text[-3000:]
        assert worker.process.poll() is None
    finally:
        if worker is not None:
            worker.stop()
        broker.stop()
