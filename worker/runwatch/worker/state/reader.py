"""Reading ``runwatch.state`` partitions back: the newest record of every run in them.

A plain read, no consumer group: assign the partitions, note each one's first and end offset as
they are now, read from the first until the position reaches the end. That one loop covers what a
compacted topic can look like: offsets with gaps (the position simply jumps them), an empty
partition (first == end: nothing to read), a log start that retention moves during the read
(``auto_offset_reset="earliest"`` puts the position at the new start), and a tail the cleaner
emptied (tombstones removed after ``delete.retention.ms``: fetches return nothing below the end
offset). A partition is taken for such a tail only when the broker has answered its fetches and *no*
partition of the read has delivered anything for ``idle_s`` (longer on a slow broker: three times the
longest wait between deliveries so far): under load one partition's fetches wait behind another's
backlog, which is no evidence that its tail is gone. Records written
after the read started are not waited for (one that arrives in time is read: the newest wins).

A read ends in failure (``StateReadError``) only when nothing at all arrived for ``timeout_s``: a large
read takes as long as it takes while it makes progress, and ``on_progress`` (records read so far) is
called about once a second so that its owner can say so.

The end offset is a lower bound, not a stop: a partition is read until its position has passed the
end offset noted at the start *and* a fetch from there returns nothing. (Tansu 0.6, the embedded
broker, answers ListOffsets with the last batch's base offset + 1, short of the records after the
first in that batch; on Kafka the extra fetch costs one fetch wait.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from runwatch.contract import topics

log = logging.getLogger(__name__)

# nothing read for this long: the read fails (and with it the worker: a successor retries)
DEFAULT_TIMEOUT_S = 25.0
IDLE_S = 5.0
PROGRESS_EVERY_S = 1.0


class StateReadError(RuntimeError):
    """The state topic could not be read within the time allowed (the worker fails: a successor retries)."""


def _assign(
    consumer: Any, topic: str, partitions: Iterable[int] | None, tail: int | None
) -> tuple[dict[Any, int], set[Any]] | None:
    """Assign ``topic``'s ``partitions`` (None: all of them) and seek each one with records to read to
    its start (its first offset, or ``tail`` short of its end): (end offsets, partitions to read), or
    None when there are no partitions (nothing assigned)."""
    from kafka import TopicPartition

    if partitions is None:
        partitions = consumer.partitions_for_topic(topic) or ()
    tps = [TopicPartition(topic, p) for p in sorted(set(partitions))]
    if not tps:
        return None
    consumer.assign(tps)
    first = consumer.beginning_offsets(tps)
    end = consumer.end_offsets(tps)
    start = {tp: first[tp] if tail is None else max(first[tp], end[tp] - tail) for tp in tps}
    todo = {tp for tp in tps if end[tp] > start[tp]}  # an empty partition: nothing to wait for
    for tp in todo:
        consumer.seek(tp, start[tp])
    return end, todo


@dataclass
class _ReadClock:
    """One read's timing and count: when it started, when any partition last delivered a record, the
    longest wait between deliveries so far (how slow the broker is today), records read, last report."""

    started: float
    last_delivery: float = field(init=False)
    longest_gap: float = 0.0
    read: int = 0
    reported: float = field(init=False)

    def __post_init__(self) -> None:
        self.last_delivery = self.reported = self.started

    def check_timeout(self, topic: str, todo: set[Any], limit: float) -> None:
        """Raise StateReadError when nothing has arrived for ``limit`` seconds."""
        now = time.monotonic()
        if now - self.last_delivery > limit:
            raise StateReadError(
                f"reading {topic} partitions {sorted(tp.partition for tp in todo)}: nothing "
                f"arrived for {limit:g} s ({self.read} records read in {now - self.started:.0f} s)"
            )

    def note_deliveries(self, batches: dict[Any, list[Any]], now: float) -> None:
        """A poll's ``batches`` came back at ``now``: if they hold records, that is a delivery."""
        if any(batches.values()):
            self.longest_gap = max(self.longest_gap, now - self.last_delivery)
            self.last_delivery = now


class StateReader:
    def __init__(
        self,
        bootstrap: str,
        topic: str = topics.STATE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        idle_s: float = IDLE_S,
        consumer: Any = None,
    ):
        """``consumer``: a kafka-python ``KafkaConsumer`` to use (else one is made for ``bootstrap``)."""
        self.bootstrap = bootstrap
        self.topic = topic
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        self._consumer = consumer
        self.on_progress: Callable[[int], None] | None = None  # records read so far, about once a second
        # key -> (partition, offset) of the value the last ``read`` returned for it (a refused record is
        # logged with where it is)
        self.origin: dict[str, tuple[int, int]] = {}

    def _client(self) -> Any:  # kafka-python's KafkaConsumer
        if self._consumer is None:
            from kafka import KafkaConsumer

            self._consumer = KafkaConsumer(
                bootstrap_servers=self.bootstrap,
                api_version=topics.KAFKA_API_VERSION,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_partition_fetch_bytes=topics.STATE_MAX_BYTES + (1 << 20),
                fetch_max_bytes=4 * topics.STATE_MAX_BYTES,
                fetch_max_wait_ms=100,
                request_timeout_ms=30_000,
            )
        return self._consumer

    def read(self, partitions: Iterable[int]) -> dict[str, bytes | None]:
        """The newest value of every key in ``partitions`` (None: a tombstone), in offset order; where
        each came from is in ``origin``."""
        newest: dict[str, bytes | None] = {}
        self.origin = {}
        for partition, record in self._records(self.topic, partitions):
            if record.key is not None:
                key = record.key.decode("utf-8", "replace")
                newest[key] = record.value
                self.origin[key] = (partition, record.offset)
        return newest

    def scan(
        self,
        topic: str,
        partitions: Iterable[int] | None = None,
        tail: int | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[tuple[bytes | None, bytes | None]]:
        """Every record's (key, value) of ``topic``'s ``partitions`` (None: all of them), in offset
        order per partition; ``tail``: only each partition's last ``tail`` offsets. Raises
        StateReadError past ``timeout_s`` (the reader's by default)."""
        with closing(self._records(topic, partitions, tail, timeout_s)) as records:
            for _, record in records:
                yield record.key, record.value

    def _records(
        self,
        topic: str,
        partitions: Iterable[int] | None = None,
        tail: int | None = None,
        timeout_s: float | None = None,
    ) -> Generator[tuple[int, Any], None, None]:
        """(partition, kafka-python ConsumerRecord) of what ``scan`` reads."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        consumer = self._client()
        assigned = _assign(consumer, topic, partitions, tail)
        if assigned is None:
            return
        end, todo = assigned
        clock = _ReadClock(time.monotonic())
        try:
            while todo:
                clock.check_timeout(topic, todo, limit)
                batches = consumer.poll(timeout_ms=200, max_records=5000)
                now = time.monotonic()
                clock.note_deliveries(batches, now)
                for tp, records in batches.items():
                    for record in records:
                        yield tp.partition, record
                    clock.read += len(records)
                if self.on_progress is not None and now - clock.reported >= PROGRESS_EVERY_S:
                    self.on_progress(clock.read)
                    clock.reported = now
                self._retire_finished(consumer, topic, todo, end, batches, clock, now)
        finally:
            consumer.assign([])

    def _retire_finished(
        self,
        consumer: Any,
        topic: str,
        todo: set[Any],
        end: dict[Any, int],
        batches: dict[Any, list[Any]],
        clock: _ReadClock,
        now: float,
    ) -> None:
        """Drop from ``todo`` the partitions read to their end, and those whose tail the cleaner emptied."""
        # A cleaned tail only when the whole read has been quiet for idle_s and three times its slowest
        # delivery so far, and the broker has answered a fetch of the partition (its high watermark)
        quiet_for = max(self.idle_s, 3 * clock.longest_gap)
        for tp in list(todo):
            if consumer.position(tp) >= end[tp] and not batches.get(tp):
                todo.discard(tp)  # past the end, and nothing more to fetch
            elif now - clock.last_delivery > quiet_for and consumer.highwater(tp) is not None:
                log.info(
                    "%s[%d]: nothing to fetch from %d below its end %d for %.1f s, nor from any other "
                    "partition: a cleaned tail, read",
                    topic,
                    tp.partition,
                    consumer.position(tp),
                    end[tp],
                    now - clock.last_delivery,
                )
                todo.discard(tp)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
