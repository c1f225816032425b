"""The watcher's step events go through ``RunWatch.queue_step``: checked by name in the training loop
(a typo raises ``UnknownFieldError`` there, at once), validated by the Kafka delivery's publisher thread in
its batch. A value that does not validate there is dropped and counted ``invalid``, never raised, and the
books still balance at close; the valid events around it go out unchanged. The client is a stand-in that
acknowledges every record (the real broker's side: every integration test that trains)."""

from __future__ import annotations

import json

import pytest
from kafka.future import Future
from kafka.producer.future import RecordMetadata

from runwatch.producer.publish.events import UnknownFieldError
from runwatch.producer.publish.kafka_delivery import KafkaDelivery
from runwatch.producer.publish.run_watch import RunWatch

NO_BROKER = "127.0.0.1:1"


class _Client:
    def __init__(self) -> None:
        self.values: list[bytes] = []

    def partitions_for(self, topic):
        return {0}

    def send(self, topic, key=None, value=None, timestamp_ms=None, partition=None):
        self.values.append(value)
        future = Future()
        return future.success(RecordMetadata(topic, 0, None, len(self.values), timestamp_ms, None, 0, 0, -1))

    def flush(self, timeout=None):
        pass

    def close(self, timeout=None):
        pass


class _Delivery(KafkaDelivery):
    def __init__(self) -> None:
        self.client = _Client()
        super().__init__("queued-run", 1, NO_BROKER, spool_path=None, batch_interval_s=0)

    def _make_producer(self):
        return self.client


@pytest.fixture
def rw():
    rw = RunWatch("queued-run", NO_BROKER, rank=1, delivery=_Delivery())
    yield rw
    rw.close(timeout=1)


def test_a_bad_value_is_counted_invalid_off_the_loop_and_the_rest_go_out(rw, caplog):
    assert rw.queue_step(0, {"loss": 1.0, "lr": [0.1]})
    assert rw.queue_step(1, {"loss": 2.0, "nonfinite_grads": -3})  # accepted now, refused by validation
    assert rw.queue_step(2, {"loss": float("nan"), "module_grad_norms": {"fc": 0.5}})
    stats = rw.close(timeout=2)
    sent = [json.loads(v) for v in rw.delivery.client.values]
    assert [(e["step"], e["loss"]) for e in sent] == [(0, 1.0), (2, "NaN")]
    assert sent[1]["module_grad_norms"] == {"fc": 0.5} and sent[0]["lr"] == [0.1]
    assert stats.drop_reasons == {"invalid": 1} and stats.published == 2
    assert stats.queued == stats.published + stats.dropped  # every event offered accounted for once
    assert "dropped an invalid StepEvent" in caplog.text


def test_a_field_name_that_is_not_declared_raises_in_the_loop(rw):
    with pytest.raises(UnknownFieldError, match="did you mean 'grad_norm'"):
        rw.queue_step(0, {"grad_nrom": 1.0})
    assert rw.stats.queued == 0


def test_the_event_time_is_when_it_was_queued_not_when_it_was_validated(rw):
    from datetime import UTC, datetime

    before = datetime.now(UTC)
    rw.queue_step(0, {"loss": 1.0})
    after = datetime.now(UTC)
    rw.close(timeout=2)
    (event,) = [json.loads(v) for v in rw.delivery.client.values]
    assert before <= datetime.fromisoformat(event["ts"]) <= after
