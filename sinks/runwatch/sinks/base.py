"""``Sink``: where the consume, write durably, commit loop (sinks/runwatch/sinks/loop.py) hands its batches.

One base for the ClickHouse sink (``SinkConsumer``, sinks/runwatch/sinks/consumer.py) and the remediator
(``RemediateConsumer``, sinks/runwatch/sinks/remediate/consumer.py); Quix Streams' ``quixstreams/sinks/base/``
is the model: a sink takes a batch of records and says how much of it is durable, and the loop that reads
Kafka commits that much and no more.

``write_batch(records)`` returns once every record it could make durable is (stored, recorded, published),
with, per (topic, partition), the first offset that is **not yet** durable; an empty answer: all of the
batch is. The loop commits each partition up to that offset, rewinds the partition to it and reads it again
after a pause, so a record is committed only once it is durable: nothing is lost, and what is read again
is written again harmlessly (every table deduplicates on its row's id; the remediator skips what it has
recorded as done).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

Partition = tuple[str, int]  # (topic, partition)


class Record(Protocol):
    """What a sink reads of a Kafka record (kafka-python's ``ConsumerRecord``)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> Any: ...
    @property
    def timestamp(self) -> int | None: ...


class Sink(ABC):
    """A destination of Kafka records written in batches; see the module docstring.

    ``stopping``: set to stop the loop (after the batch in hand); ``assigned``: set by the loop once the
    consumer has partitions. ``label`` starts the loop's log lines."""

    label = "sink"

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.assigned = threading.Event()

    @abstractmethod
    def write_batch(self, records: Sequence[Record]) -> dict[Partition, int]:
        """Make ``records`` durable; returns per partition the first offset that is not yet
        (empty: all of them are)."""

    def committed(self, upto: Mapping[Partition, int]) -> None:  # noqa: B027 - a hook, optional
        """The offsets just committed, per partition (attempted: a failed commit is carried by the next)."""

    def commit_failed(self, exc: Exception) -> None:  # noqa: B027 - a hook, optional
        """An offset commit failed (broker unreachable, rebalance): what was written stays durable."""

    def idle(self) -> None:  # noqa: B027 - a hook, optional
        """A poll returned nothing."""


def first_offsets(records: Iterable[Record]) -> dict[Partition, int]:
    """Per partition, the lowest offset of ``records``: what ``write_batch`` returns for the records it
    could not make durable."""
    first: dict[Partition, int] = {}
    for r in records:
        key = (r.topic, r.partition)
        first[key] = min(first.get(key, r.offset), r.offset)
    return first
