"""The action listener's fetch wait follows its run: short while the run publishes (an action may answer its
events) and after an action for it arrived, long once it is idle, so that an idle listener costs next to
nothing (with the embedded broker, each fetch costs the trainer's process CPU and a wait of W ms delays an
action by up to W/2: reader.py, docs/profiles/worker.md)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest

from runwatch.producer.actions.reader import (
    ACTIVE_FOR_S,
    FETCH_WAIT_MS,
    IDLE_FETCH_WAIT_MS,
    ActionReader,
    fetch_wait_ms,
)


class FakeConsumer:
    """What the reader sets on kafka-python's consumer: its fetcher's config, read per fetch request."""

    def __init__(self) -> None:
        self._fetcher = type("Fetcher", (), {"config": {"fetch_max_wait_ms": 0}})()

    @property
    def wait(self) -> Any:
        return self._fetcher.config["fetch_max_wait_ms"]


def test_the_idle_wait_is_longer_than_the_active_one() -> None:
    assert FETCH_WAIT_MS < IDLE_FETCH_WAIT_MS
    assert fetch_wait_ms(100.0, 100.0 - ACTIVE_FOR_S / 2) == FETCH_WAIT_MS
    assert fetch_wait_ms(100.0, 100.0 - ACTIVE_FOR_S - 0.1) == IDLE_FETCH_WAIT_MS


def test_the_wait_is_short_while_the_run_publishes_and_long_once_it_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    published = [0]
    reader = ActionReader(
        "unused:9092",
        "runwatch.actions",
        datetime.now(UTC),
        lambda raw: None,
        client_id="test",
        activity=lambda: published[0],
    )
    consumer = FakeConsumer()
    assert reader._fetch_wait(consumer) == FETCH_WAIT_MS  # (a new listener: its run is starting)
    assert consumer.wait == FETCH_WAIT_MS
    clock[0] += ACTIVE_FOR_S + 1  # nothing published since
    assert reader._fetch_wait(consumer) == IDLE_FETCH_WAIT_MS
    assert consumer.wait == IDLE_FETCH_WAIT_MS
    published[0] += 1  # the run steps again
    assert reader._fetch_wait(consumer) == FETCH_WAIT_MS
    assert consumer.wait == FETCH_WAIT_MS
    clock[0] += ACTIVE_FOR_S - 1  # still within the window
    assert reader._fetch_wait(consumer) == FETCH_WAIT_MS
    clock[0] += 2
    assert reader._fetch_wait(consumer) == IDLE_FETCH_WAIT_MS


def test_kafka_python_reads_the_wait_where_the_reader_sets_it() -> None:
    # (a kafka-python that kept it elsewhere would leave every fetch at the consumer's first wait)
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(api_version=(2, 8), fetch_max_wait_ms=FETCH_WAIT_MS)
    try:
        assert consumer._fetcher.config["fetch_max_wait_ms"] == FETCH_WAIT_MS
    finally:
        consumer.close()
    import inspect

    from kafka.consumer.fetcher import Fetcher

    assert "self.config['fetch_max_wait_ms']" in inspect.getsource(Fetcher._create_fetch_requests)
