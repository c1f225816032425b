"""The listener's consumer thread on ``runwatch.actions``.

Actions are per run, not per rank: every rank's reader reads every partition (no consumer group,
nothing committed), from the listener's start time, and hands each record's raw value to the
listener. A broker that is down or a topic that does not exist yet is retried; nothing is ever
raised into training.

How long the broker may hold a fetch that finds nothing follows the run (``fetch_wait_ms``): short while
an action may be on its way (the run published lately, or an action for it arrived), long once it is idle,
so that an idle listener costs next to nothing. The embedded broker (Tansu) answers a fetch not when records
arrive but when it looks again, after half the wait left (then a quarter, ...): an action that arrives
during a wait of W ms is handed over up to W/2 ms later, about W/6 on average, and every fetch costs this
thread about 1.3 ms of CPU on a 2-core VM (docs/profiles/worker.md). Apache Kafka answers as soon as
records arrive, whatever the wait.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime

from runwatch.contract import topics

log = logging.getLogger(__name__)

# While an action may be on its way: a fetch at most every 20 ms (about 6% of a core on the 2-core VM;
# with Tansu an action waits up to 10 ms, 3 on average)
FETCH_WAIT_MS = max(1, int(os.environ.get("RUNWATCH_ACTIONS_FETCH_WAIT_MS", "20")))
# Idle: two fetches a second (about 0.3% of a core; with Tansu the first action after a quiet spell waits
# up to 250 ms)
IDLE_FETCH_WAIT_MS = max(FETCH_WAIT_MS, int(os.environ.get("RUNWATCH_ACTIONS_IDLE_FETCH_WAIT_MS", "500")))
# How long after the run last published (or an action for it arrived) the short wait is kept: actions
# answer events within milliseconds to seconds; a run that stops publishing for longer is idle
ACTIVE_FOR_S = 5.0
# The shortest a poll of the consumer lasts when nothing arrives (each costs Python, records or not)
MIN_POLL_MS = 100


def fetch_wait_ms(now: float, active_at: float, active_for_s: float = ACTIVE_FOR_S) -> int:
    """The fetch wait for a listener whose run was last active (published, or got an action) at
    ``active_at`` (monotonic seconds)."""
    return FETCH_WAIT_MS if now - active_at < active_for_s else IDLE_FETCH_WAIT_MS


class ActionReader:
    """A daemon thread (started by :meth:`start`) that calls ``on_value(raw)`` for every record of
    ``topic`` from ``start_at`` on; ``ready`` is set once it has its partitions."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        start_at: datetime,
        on_value: Callable[[bytes], None],
        *,
        client_id: str,
        key: bytes | None = None,
        activity: Callable[[], int] | None = None,
    ):
        """``key``: the run's (its actions' record key): its records are handed on whatever their time.
        ``activity``: a count that changes whenever the run publishes (its events queued and sent): the
        fetch wait stays short while it does (``fetch_wait_ms``)."""
        self._bootstrap = bootstrap
        self._topic = topic
        self._start_ms = int(start_at.timestamp() * 1000)
        self._key = key
        self._on_value = on_value
        self._client_id = client_id
        self._activity = activity
        self._seen_activity: int | None = None
        self._active_at = time.monotonic()  # (a listener starts with its run: an action may come soon)
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._consume, name="runwatch-actions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _consume(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        consumer = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = KafkaConsumer(
                        bootstrap_servers=self._bootstrap,
                        api_version=topics.KAFKA_API_VERSION,
                        enable_auto_commit=False,
                        auto_offset_reset="earliest",
                        fetch_max_wait_ms=FETCH_WAIT_MS,
                        client_id=self._client_id,
                    )
                    partitions = consumer.partitions_for_topic(self._topic) or set()
                    if not partitions:
                        consumer.close()
                        consumer = None
                        self._stop.wait(0.5)
                        continue
                    tps = [TopicPartition(self._topic, p) for p in sorted(partitions)]
                    consumer.assign(tps)
                    # Start at the listener's start time; older actions are not ours to act on. A partition
                    # with no record since then starts at its end as of before the lookup (nothing appended
                    # meanwhile is missed), never at its beginning: that is every other run's history.
                    # (Tansu answers "none" as offset 0 with timestamp -1.)
                    ends = consumer.end_offsets(tps)
                    for tp, found in consumer.offsets_for_times({tp: self._start_ms for tp in tps}).items():
                        consumer.seek(
                            tp, found.offset if found is not None and found.timestamp >= 0 else ends[tp]
                        )
                    self.ready.set()
                wait_ms = self._fetch_wait(consumer)
                for records in consumer.poll(timeout_ms=max(MIN_POLL_MS, wait_ms)).values():
                    for record in records:
                        # a broker whose end offset falls short (Tansu's points into its last batch) may
                        # still hand over older records: another run's sent before the start are not ours.
                        # This run's go to the inbox whatever their time: they are stamped on the worker's
                        # clock, which may be behind this host's by minutes, and the inbox judges them by
                        # the times and the clock offset the worker signed (Action.issuer_now).
                        mine = self._key is not None and record.key == self._key
                        if mine:
                            self._active_at = time.monotonic()  # (another may follow: a rollback's recovery)
                        if mine or record.timestamp is None or record.timestamp >= self._start_ms:
                            self._on_value(record.value)
            except Exception as exc:  # noqa: BLE001 - broker down: retry, never raise into training
                log.debug("runwatch: action consumer error: %r", exc)
                if consumer is not None:
                    try:
                        consumer.close()
                    except Exception:  # noqa: BLE001 - a best-effort close
                        pass
                consumer = None
                self._stop.wait(1.0)
        if consumer is not None:
            consumer.close()

    def _fetch_wait(self, consumer: object) -> int:
        """The wait for the consumer's next fetch (set on it), from the run's activity."""
        now = time.monotonic()
        if self._activity is not None:
            seen = self._activity()
            if seen != self._seen_activity:
                self._seen_activity, self._active_at = seen, now
        wait_ms = fetch_wait_ms(now, self._active_at)
        # (kafka-python reads it from its fetcher's config as it builds each fetch request)
        config = getattr(getattr(consumer, "_fetcher", None), "config", None)
        if isinstance(config, dict):
            config["fetch_max_wait_ms"] = wait_ms
        return wait_ms
