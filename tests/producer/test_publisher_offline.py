"""RunWatch with no broker (bootstrap 127.0.0.1:1, where nothing listens). The training loop must never
wait on the network or see an exception from it: construction and publishing return at once, what
cannot be queued is dropped and counted by reason, and after close() every offered event is accounted
for exactly once (published + dropped == offered), and stays so. The disk spool is off here
(spool=False): these tests are about the drop path; tests/producer/test_spool.py covers the spool."""

from __future__ import annotations

import time

import pytest
from kafka.future import Future
from kafka.producer.future import RecordMetadata

from runwatch.contract.schema import HeartbeatEvent
from runwatch.producer.publish.kafka_delivery import KafkaDelivery
from runwatch.producer.publish.run_watch import RunWatch

NO_BROKER = "127.0.0.1:1"


@pytest.fixture
def make_rw():
    created: list[RunWatch] = []

    def make(**kwargs) -> RunWatch:
        kwargs.setdefault("spool", False)
        rw = RunWatch(kwargs.pop("run_id", "offline-run"), NO_BROKER, **kwargs)
        created.append(rw)
        return rw

    yield make
    for rw in created:
        rw.close(timeout=0.1)  # no-op if the test closed it; keeps atexit from waiting


def test_construction_returns_immediately(make_rw):
    t = time.monotonic()
    rw = make_rw()
    assert time.monotonic() - t < 1.0
    assert rw.stats.queued == 1  # rank 0 announces the run (run_start)


def test_only_rank_zero_announces_the_run(make_rw):
    rw = make_rw(rank=3, world_size=4)
    assert rw.stats.queued == 0


def test_empty_run_id_is_refused():
    with pytest.raises(ValueError):
        RunWatch("", NO_BROKER)


def test_a_thousand_publishes_never_block_or_raise(make_rw):
    rw = make_rw()
    t = time.monotonic()
    results = [
        rw.step(i, loss=1.0 / (i + 1), grad_norm=float("nan") if i % 7 == 0 else 2.0) for i in range(1000)
    ]
    elapsed = time.monotonic() - t
    # blocking on the missing broker (max_block_ms=100 per send) would take ~100 s
    assert elapsed < 2.0
    assert all(results)
    assert rw.stats.queued == 1001
    assert rw.stats.published == 0


def test_other_publish_helpers_never_raise(make_rw):
    rw = make_rw()
    assert rw.eval(10, loss=1.5, metrics={"acc": 0.5})
    assert rw.heartbeat(10, phase="eval", time_in_phase_s=1.0)
    ref = rw.checkpoint(10, "/ckpt/10.pt")
    assert rw.checkpoints == [ref]
    rw.checkpoint(11, "/ckpt/11.pt", ok=False)
    assert rw.checkpoints == [ref]  # a failed checkpoint is never a rollback target
    assert rw.ack(action_id="a1", action_kind="alert", outcome="applied")
    assert rw.publish(HeartbeatEvent(run_id="offline-run"))


def test_full_queue_drops_are_counted_by_reason(make_rw):
    rw = make_rw(queue_size=10)
    results = [rw.step(i, loss=1.0) for i in range(100)]
    assert results.count(False) == rw.stats.drop_reasons["queue_full"]
    # the queue holds at most 10 (run_start took one slot); the drain thread may free a few
    assert rw.stats.drop_reasons["queue_full"] >= 100 - 10
    assert rw.stats.queued + rw.stats.drop_reasons["queue_full"] == 101
    assert rw.stats.dropped >= rw.stats.drop_reasons["queue_full"]


def test_close_returns_promptly_and_accounts_for_every_event(make_rw):
    rw = make_rw(queue_size=10)
    offered = 1  # run_start
    for i in range(100):
        rw.step(i, loss=1.0)
        offered += 1
    t = time.monotonic()
    stats = rw.close(timeout=0.5)
    offered += 1  # run_end, published by close()
    assert time.monotonic() - t < 5.0
    assert stats.published == 0
    assert stats.published + stats.dropped == offered
    assert sum(stats.drop_reasons.values()) == stats.dropped
    assert set(stats.drop_reasons) <= {"queue_full", "send_failed", "undelivered_at_close"}


def test_close_with_a_backlog_returns_within_its_timeout(make_rw):
    rw = make_rw()
    for i in range(300):
        rw.step(i, loss=1.0)
    t = time.monotonic()
    stats = rw.close(timeout=1)
    assert time.monotonic() - t < 1 + 3.0  # the timeout, plus a bounded client shutdown
    assert stats.published + stats.dropped == 302
    assert stats.drop_reasons.get("undelivered_at_close", 0) > 0


def test_stats_stay_final_after_close():
    """close() counts the backlog as undelivered; a stuck client that acknowledges afterwards must not
    count anything a second time. No sleep: the late acknowledgements are made here, after close()."""
    futures: list[Future] = []

    class StuckClient:  # kafka-python's KafkaProducer as KafkaDelivery uses it; nothing is ever acknowledged
        def partitions_for(self, topic):
            return {0}

        def send(self, topic, key=None, value=None, timestamp_ms=None, partition=None):
            futures.append(Future())
            return futures[-1]

        def flush(self, timeout=None):
            pass

        def close(self, timeout=None):
            pass

    class StuckDelivery(KafkaDelivery):
        def _make_producer(self):
            return StuckClient()

    delivery = StuckDelivery("offline-run", 0, NO_BROKER, spool_path=None, batch_interval_s=0)
    rw = RunWatch("offline-run", NO_BROKER, delivery=delivery)
    for i in range(50):
        rw.step(i, loss=1.0)
    rw.close(timeout=0.3)
    snapshot = (rw.stats.published, rw.stats.dropped, dict(rw.stats.drop_reasons))
    assert futures and snapshot[0] == 0 and snapshot[1] == 52  # all handed over, none acknowledged in time
    for offset, future in enumerate(futures):  # the client comes back to life after close()
        future.success(RecordMetadata("runwatch.telemetry", 0, None, offset, None, None, 1, 1, -1))
    assert (rw.stats.published, rw.stats.dropped, dict(rw.stats.drop_reasons)) == snapshot


def test_publish_after_close_is_dropped_as_closed(make_rw):
    rw = make_rw(queue_size=10)
    rw.close(timeout=0.3)
    before = rw.stats.dropped
    assert rw.step(1, loss=1.0) is False
    assert rw.stats.drop_reasons["closed"] == 1
    assert rw.stats.dropped == before + 1
    assert rw.close(timeout=0.3) is rw.stats  # closing twice is harmless


def test_invalid_arguments_are_counted_not_raised_into_the_loop():
    """A typo'd field type or a negative step must not kill a long training run."""
    rw = RunWatch("bad-args", "127.0.0.1:1", rank=1, spool=False)
    assert rw.step(-1, loss=1.0) is False
    assert rw.step(3, loss="not a number") is False
    assert rw.heartbeat(3, phase="napping") is False
    assert rw.step(4, loss=1.0) is True
    stats = rw.close(timeout=0.5)
    assert stats.drop_reasons["invalid"] == 3
    assert stats.published + stats.dropped == 4


class CapturingRunWatch(RunWatch):
    """Keeps a copy of every event offered, to look at what the constructor announces."""

    def publish(self, event):
        self.__dict__.setdefault("offered", []).append(event)
        return super().publish(event)


def test_rank_zero_publishes_collected_run_metadata(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rw = CapturingRunWatch(
        "meta-run",
        NO_BROKER,
        spool=False,
        config={"lr": 3e-4, "layers": 12},
        seed=7,
        tags={"team": "audio"},
        baseline_key="audio-small",
        run_start={"dataset_version": "v3"},
    )
    rw.close(timeout=0.1)
    event = rw.offered[0]
    assert event.kind == "run_start"
    assert (rw.rank, rw.world_size, event.world_size) == (0, 4, 4)
    assert event.config == {"lr": 3e-4, "layers": 12} and len(event.config_hash) == 16
    assert event.seed == 7 and event.tags == {"team": "audio"} and event.baseline_key == "audio-small"
    assert event.dataset_version == "v3"  # run_start adds to (and overrides) what was collected
    assert event.host and event.torch_version


def test_rank_and_world_size_come_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rw = CapturingRunWatch("env-rank", NO_BROKER, spool=False)
    rw.close(timeout=0.1)
    assert (rw.rank, rw.world_size) == (3, 4)
    assert "offered" not in rw.__dict__  # only rank 0 announces the run
