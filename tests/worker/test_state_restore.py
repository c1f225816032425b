"""Restoring runs from ``runwatch.state`` on a real broker (issue 16): an empty state topic, one that
holds superseded snapshots and tombstones (a compacted topic before and after the cleaner has run
look alike to the reader: the newest record per key wins), and a record that cannot be read (logged,
that run starts fresh, the others are restored and the worker goes on)."""

from __future__ import annotations

import logging
import re
import time
from datetime import UTC, datetime, timedelta

import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import StepEvent
from runwatch.detectors.config import RunwatchConfig
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.worker.processor import StateRecord, TelemetryProcessor
from runwatch.worker.state.reader import StateReader
from runwatch.worker.state.run_states import StateOptions
from tests.support.action_keys import SEED

pytestmark = pytest.mark.integration

SECRET = SEED  # the workers' action signing key
STATE_SECRET = b"integration-state-secret-of-32-bytes-ok"
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)  # within the worker clock's 7-day window
GROUP = "restore-test"


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    with EmbeddedBroker(log_path=tmp_path_factory.mktemp("state") / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        yield broker.bootstrap


def _processor(bootstrap: str) -> TelemetryProcessor:
    return TelemetryProcessor(
        RunwatchConfig(),
        SECRET,
        state_reader=StateReader(bootstrap, timeout_s=20),
        state=StateOptions(every_events=10_000, interval_s=1e9),
        group=GROUP,
        state_secret=STATE_SECRET,
    )


def _steps(run_id: str, first: int, last: int) -> list[bytes]:
    return [
        StepEvent(run_id=run_id, step=s, loss=1.0 + 0.01 * (s % 3), ts=T0 + timedelta(seconds=s)).to_json()
        for s in range(first, last)
    ]


def _publish(bootstrap: str, records: list[StateRecord | tuple[str, int, bytes | None]]) -> None:
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        max_request_size=topics.STATE_MAX_BYTES,
    )
    for r in records:
        key, partition, value = (r.key, r.partition, r.value) if isinstance(r, StateRecord) else r
        producer.send(topics.STATE, key=key.encode(), value=value, partition=partition)
    producer.flush(30)
    producer.close()


def _feed(
    proc: TelemetryProcessor, run_id: str, partition: int, raws: list[bytes], first_offset: int
) -> None:
    for i, raw in enumerate(raws):
        result = proc.process(raw, key=run_id.encode(), partition=partition, offset=first_offset + i)
        assert result.deadletter is None and not result.errors


def test_an_empty_state_topic_restores_nothing_at_once(bootstrap):
    proc = _processor(bootstrap)
    started = time.monotonic()
    assert proc.keep_partitions({0, 1, 2, 3}) == []
    assert time.monotonic() - started < 10  # an empty partition is not waited on
    assert proc.counters.restored_runs == 0 and proc.monitors == {}
    _feed(proc, "fresh", 0, _steps("fresh", 0, 5), 0)
    assert proc.monitors["fresh"].events_seen == 5


def test_the_newest_snapshot_of_each_run_is_restored_and_a_tombstoned_run_is_not(bootstrap):
    first = _processor(bootstrap)
    first.keep_partitions({1})
    _feed(first, "kept", 1, _steps("kept", 0, 30), 0)
    _feed(first, "deleted", 1, _steps("deleted", 0, 10), 30)
    older, _ = first.take_snapshots(force_checkpoint=True)
    _feed(first, "kept", 1, _steps("kept", 30, 50), 40)
    newer, _ = first.take_snapshots(force_checkpoint=True)
    assert [r.key for r in newer] == [f"{GROUP}/kept"]
    _publish(
        bootstrap, [*older, *newer, (f"{GROUP}/deleted", 1, None), ("another-group/kept", 1, b"not ours")]
    )

    second = _processor(bootstrap)
    second.keep_partitions({1})
    assert set(second.monitors) == {"kept"} and second.counters.restored_runs == 1
    assert second.monitors["kept"].events_seen == 50 and second.monitors["kept"].last_step == 49
    # events the snapshot holds are skipped when read again; the ones after it are handled
    _feed(second, "kept", 1, _steps("kept", 30, 55), 40)
    assert second.counters.replay_skipped == 20 and second.monitors["kept"].events_seen == 55


def test_a_record_that_cannot_be_read_is_logged_and_its_run_starts_fresh(bootstrap, caplog):
    first = _processor(bootstrap)
    first.keep_partitions({2})
    _feed(first, "good", 2, _steps("good", 0, 20), 0)
    good, _ = first.take_snapshots(force_checkpoint=True)
    forged = _processor(bootstrap)
    forged._state_secret = b"someone-else-s-secret-32-bytes-long-xx"  # signed, but not by this deployment
    forged.keep_partitions({2})
    _feed(forged, "forged", 2, _steps("forged", 0, 20), 20)
    unsigned, _ = forged.take_snapshots(force_checkpoint=True)
    _publish(bootstrap, [*good, *unsigned, (f"{GROUP}/garbage", 2, b"\x00not a snapshot at all")])

    second = _processor(bootstrap)
    with caplog.at_level(logging.ERROR, logger="runwatch.worker"):
        second.keep_partitions({2})
    assert set(second.monitors) == {"good"} and second.counters.restore_failures == 2
    said = " ".join(r.getMessage() for r in caplog.records)
    # (said with where the record is: the topic, its partition and offset)
    assert re.search(r"run forged: its state record runwatch\.state\[2\]@\d+ cannot be read", said), said
    assert "not signed" in said
    assert re.search(r"run garbage: its state record runwatch\.state\[2\]@\d+ cannot be read", said)
    assert "bad magic" in said
    # the worker goes on: the unreadable runs start fresh, the restored one carries on
    _feed(second, "forged", 2, _steps("forged", 20, 25), 40)
    _feed(second, "garbage", 2, _steps("garbage", 0, 5), 45)
    _feed(second, "good", 2, _steps("good", 20, 25), 50)
    assert second.monitors["forged"].events_seen == 5 and second.monitors["garbage"].events_seen == 5
    assert second.monitors["good"].events_seen == 25


def test_what_the_predecessor_published_after_its_last_snapshot_is_not_published_again(bootstrap):
    """The predecessor published a loss spike's finding, and died before the broker took the snapshot
    sent after it: its successor restores the snapshot before, replays the events since, decides the
    same finding again, finds it on runwatch.anomalies, and withholds it."""
    raws = _steps("spiky", 0, 60)
    raws[45] = StepEvent(run_id="spiky", step=45, loss=8.0, ts=T0 + timedelta(seconds=45)).to_json()
    first = _processor(bootstrap)
    first.keep_partitions({3})
    _feed(first, "spiky", 3, raws[:40], 0)
    snapshot, _ = first.take_snapshots(force_checkpoint=True)
    _publish(bootstrap, snapshot)
    results = [
        first.process(raw, key=b"spiky", partition=3, offset=40 + i) for i, raw in enumerate(raws[40:])
    ]
    published = [a for r in results for a in r.anomalies]
    assert [a.detector for a in published] == ["loss_spike"]
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    for anomaly in published:  # as the worker sends them (keyed by run); the snapshot after them is lost
        producer.send(topics.ANOMALIES, key=b"spiky", value=anomaly.to_json())
    producer.flush(30)
    producer.close()

    second = _processor(bootstrap)
    second.keep_partitions({3})
    assert second.counters.restored_runs == 1 and second.monitors["spiky"].events_seen == 40
    again = [second.process(raw, key=b"spiky", partition=3, offset=40 + i) for i, raw in enumerate(raws[40:])]
    assert [a for r in again for a in r.anomalies] == []
    assert second.counters.repeats_withheld == 1
    # a run that did not get that far is not held back: a third processor, the state read before
    # the spike and nothing published for run "calm", reports its own spike
    calm = _processor(bootstrap)
    calm.keep_partitions({3})
    spike = StepEvent(run_id="calm", step=45, loss=8.0, ts=T0 + timedelta(seconds=45)).to_json()
    found = [
        calm.process(raw, key=b"calm", partition=3, offset=100 + i)
        for i, raw in enumerate([*_steps("calm", 0, 45), spike])
    ]
    assert [a.detector for r in found for a in r.anomalies] == ["loss_spike"]
