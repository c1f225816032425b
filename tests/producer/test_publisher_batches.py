"""The publisher sends a fast loop's events in batches, at most every ``batch_interval_s``: each produce
request costs kafka-python's sender thread about 1.5 ms of Python under the GIL, whatever it holds, so a
request per event was most of runwatch's host cost on a fast loop (docs/benchmarks.md). An event after a
quieter spell still goes at once, and close() does not wait out the interval. The client here is a
stand-in that records when each record was handed to it (the real broker's side is in
tests/producer/test_spool_outage.py and every integration test that trains)."""

from __future__ import annotations

import threading
import time

import pytest
from kafka.future import Future
from kafka.producer.future import RecordMetadata

from runwatch.contract.schema import HeartbeatEvent
from runwatch.producer.publish.kafka_delivery import KafkaDelivery


class _RecordingClient:
    """kafka-python's KafkaProducer as far as KafkaDelivery uses it; every send succeeds at once."""

    def __init__(self):
        self.sent: list[float] = []  # monotonic time of each record handed over
        self._lock = threading.Lock()

    def partitions_for(self, topic):
        return {0}

    def send(self, topic, key=None, value=None, timestamp_ms=None, partition=None):
        with self._lock:
            self.sent.append(time.monotonic())
            offset = len(self.sent) - 1
        future = Future()
        future.success(
            RecordMetadata(topic, 0, None, offset, timestamp_ms, None, len(key or b""), len(value or b""), -1)
        )
        return future

    def flush(self, timeout=None):
        pass

    def close(self, timeout=None):
        pass


class _Delivery(KafkaDelivery):
    def __init__(self, **kwargs):
        self.client = _RecordingClient()
        super().__init__("batched-run", 0, "127.0.0.1:1", spool_path=None, **kwargs)

    def _make_producer(self):
        return self.client


def _bursts(times: list[float], gap_s: float) -> list[int]:
    """The sizes of the groups of sends that follow each other within ``gap_s``."""
    sizes = [1]
    for before, after in zip(times, times[1:], strict=False):
        if after - before > gap_s:
            sizes.append(1)
        else:
            sizes[-1] += 1
    return sizes


def _event(i: int) -> HeartbeatEvent:
    return HeartbeatEvent(run_id="batched-run", step=i)


@pytest.fixture
def delivery():
    made: list[_Delivery] = []

    def make(**kwargs) -> _Delivery:
        made.append(_Delivery(**kwargs))
        return made[-1]

    yield make
    for d in made:
        d.close(timeout=2)


def test_a_fast_loops_events_share_a_few_batches_and_the_first_goes_at_once(delivery):
    d = delivery(batch_interval_s=0.5)
    started = time.monotonic()
    d.deliver(_event(0))
    for i in range(1, 100):  # a fast loop: an event every 2 ms for about 0.2 s
        time.sleep(0.002)
        d.deliver(_event(i))
    deadline = time.monotonic() + 10
    while len(d.client.sent) < 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = d.client.sent
    assert len(sent) == 100
    assert sent[0] - started < 0.25  # the first event after a quiet spell is not held back
    # every later one waits for the next batch, half a second after the first: two batches, not 100
    # (a busy machine may split one: the gap that splits is far shorter than the interval)
    bursts = _bursts(sent, 0.1)
    assert len(bursts) <= 3 and bursts[0] < 50, bursts
    assert sent[-1] - sent[0] >= 0.4  # held for the interval, not sent as they came


def test_close_sends_what_is_held_without_waiting_out_the_interval(delivery):
    d = delivery(batch_interval_s=5.0)
    d.deliver(_event(0))
    deadline = time.monotonic() + 10
    while not d.client.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(1, 20):
        d.deliver(_event(i))  # held: the next batch is due 5 s after the first
    time.sleep(0.2)
    assert len(d.client.sent) == 1
    started = time.monotonic()
    d.close(timeout=10)
    assert time.monotonic() - started < 2.5
    assert len(d.client.sent) == 20 and d.stats.published == 20 and d.stats.dropped == 0


def test_no_interval_sends_each_wake_at_once(delivery):
    d = delivery(batch_interval_s=0)
    for i in range(5):
        d.deliver(_event(i))
        time.sleep(0.3)
    assert len(_bursts(d.client.sent, 0.1)) == 5


@pytest.mark.parametrize("bad", [-1, 11, float("nan")])
def test_a_bad_interval_is_refused(bad):
    with pytest.raises(ValueError, match="batch_interval_s"):
        KafkaDelivery("r", 0, "127.0.0.1:1", spool_path=None, batch_interval_s=bad)
