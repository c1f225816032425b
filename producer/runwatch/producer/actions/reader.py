"""The listener's consumer thread on ``runwatch.actions``.

Actions are per run, not per rank: every rank's reader reads every partition (no consumer group,
nothing committed), from the listener's start time, and hands each record's raw value to the
listener. A broker that is down or a topic that does not exist yet is retried; nothing is ever
raised into training.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime

from runwatch.contract import topics

log = logging.getLogger(__name__)


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
    ):
        """``key``: the run's (its actions' record key): its records are handed on whatever their time."""
        self._bootstrap = bootstrap
        self._topic = topic
        self._start_ms = int(start_at.timestamp() * 1000)
        self._key = key
        self._on_value = on_value
        self._client_id = client_id
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
                        fetch_max_wait_ms=20,  # an action should reach the loop within a step or two
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
                for records in consumer.poll(timeout_ms=100).values():
                    for record in records:
                        # a broker whose end offset falls short (Tansu's points into its last batch) may
                        # still hand over older records: another run's sent before the start are not ours.
                        # This run's go to the inbox whatever their time: they are stamped on the worker's
                        # clock, which may be behind this host's by minutes, and the inbox judges them by
                        # the times and the clock offset the worker signed (Action.issuer_now).
                        mine = self._key is not None and record.key == self._key
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
