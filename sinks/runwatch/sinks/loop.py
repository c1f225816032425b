"""The one "consume, write durably, commit" loop of the ClickHouse sink and the remediator.

``ConsumeLoop`` polls a Kafka consumer (auto-commit off), gathers records into a batch (by
size and time), hands the batch to its ``Sink`` (sinks/runwatch/sinks/base.py), whose ``write_batch``
returns only once the records are durable, and then commits their offsets. ``write_batch`` returns, per
(topic, partition), the first offset it could *not* make durable: that partition is rewound to it and
nothing is committed past it, and the loop pauses (with backoff) before reading it again. Stops when the
sink's ``stopping`` is set, after flushing (``drain=True``) or dropping (``drain=False``, re-delivered to
the next owner) what is pending. ``retry_durably`` is the shared "keep trying to store it until stopped".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from runwatch.contract import topics
from runwatch.sinks.base import Partition, Sink

log = logging.getLogger(__name__)

T = TypeVar("T")


def make_consumer(
    bootstrap: str,
    topic_names: Iterable[str],
    *,
    group_id: str,
    session_timeout_ms: int,
    client_id: str,
    **options: Any,
) -> Any:
    """A kafka-python ``KafkaConsumer`` subscribed to ``topic_names``: manual commits, from the
    earliest offset when the group has none."""
    from kafka import KafkaConsumer

    return KafkaConsumer(
        *topic_names,
        bootstrap_servers=bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=session_timeout_ms,
        heartbeat_interval_ms=1000,
        client_id=client_id,
        **options,
    )


def retry_durably(
    attempt: Callable[[], T],
    *,
    stopping: threading.Event,
    errors: type[BaseException] | tuple[type[BaseException], ...],
    on_error: Callable[[BaseException, float], None],
    give_up: Callable[[], bool] = lambda: True,
) -> T:
    """``attempt()`` until it succeeds, backing off 0.5 s doubling to 10 s; ``on_error(exc, delay)``
    counts and logs each failure. Once ``stopping`` is set, the error is raised as soon as
    ``give_up()`` says so (never committing past what was not stored is the caller's)."""
    delay = 0.5
    while True:
        try:
            return attempt()
        except errors as exc:
            on_error(exc, delay)
            if stopping.wait(delay) and give_up():
                raise
            delay = min(delay * 2, 10.0)


class ConsumeLoop:
    """Poll, have ``sink`` write a batch until it is durable, commit; see the module docstring.

    ``commit_timeout_ms`` ``None`` waits for the commit as long as it takes."""

    def __init__(
        self,
        sink: Sink,
        *,
        batch_size: int,
        batch_interval_s: float = 0.0,
        drain: bool = True,
        commit_timeout_ms: int | None = None,
    ):
        self.sink = sink
        self.stopping = sink.stopping
        self.assigned = sink.assigned
        self.label = sink.label
        self.batch_size = batch_size
        self.batch_interval_s = batch_interval_s
        self.drain = drain
        self.commit_timeout_ms = commit_timeout_ms
        self.rewind_delay = 0.5  # pause before re-reading what could not be made durable

    def run(self, consumer: Any) -> None:
        """Consume until ``stopping`` is set; closes ``consumer`` before returning."""
        pending: list[Any] = []  # kafka-python ConsumerRecords
        started = time.monotonic()
        try:
            while True:
                stopping = self.stopping.is_set()
                if stopping and not self.drain:
                    break  # what was not committed is read again by the next owner
                polled = consumer.poll(timeout_ms=100 if not stopping else 0, max_records=self.batch_size)
                if consumer.assignment():
                    self.assigned.set()
                got = [r for records in polled.values() for r in records]
                if not got:
                    self.sink.idle()
                pending.extend(got)
                due = time.monotonic() - started >= self.batch_interval_s
                if pending and (len(pending) >= self.batch_size or due or stopping):
                    complete = self.flush(consumer, pending)
                    pending = []
                    started = time.monotonic()
                    if stopping and not complete:
                        break  # what was not committed is read again by the next owner
                elif not pending:
                    started = time.monotonic()
                if stopping and not got and not pending:
                    break
        finally:
            consumer.close()

    def flush(self, consumer: Any, pending: list[Any]) -> bool:
        """Write ``pending``, commit what is durable. Returns False when a partition was rewound
        (after a pause, growing while it keeps happening)."""
        failed = self.sink.write_batch(pending)
        self.commit(consumer, pending, failed)
        if failed:
            self.stopping.wait(self.rewind_delay)  # the rewound messages come again after a pause
            self.rewind_delay = min(self.rewind_delay * 2, 10.0)
            return False
        self.rewind_delay = 0.5
        return True

    def commit(self, consumer: Any, pending: list[Any], failed: Mapping[Partition, int]) -> None:
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        upto: dict[Partition, int] = {}
        for r in pending:
            key = (r.topic, r.partition)
            upto[key] = max(upto.get(key, 0), r.offset + 1)
        for key, offset in failed.items():
            upto[key] = offset
            try:  # read it (and what follows, acted on again harmlessly) once more
                consumer.seek(TopicPartition(*key), offset)
            except Exception as exc:  # noqa: BLE001 - partition revoked: its next owner reads it from
                # the commit
                log.warning("%s: cannot rewind %s[%d] to %d (%r)", self.label, key[0], key[1], offset, exc)
        try:
            consumer.commit(
                offsets={TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in upto.items()},
                timeout_ms=self.commit_timeout_ms,
            )
        except Exception as exc:  # noqa: BLE001 - broker unreachable or group rebalanced: what was acted
            # on is durable, and the next commit covers these offsets too; at worst they are re-delivered
            # and deduplicated
            self.sink.commit_failed(exc)
            log.warning("%s: offset commit failed (%r); carrying on", self.label, exc)
        self.sink.committed(upto)
