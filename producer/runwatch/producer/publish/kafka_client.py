"""The kafka-python client as ``KafkaDelivery`` uses it: its settings, the partition a record goes to, the
record's value and timestamp, and which failures no retry can cure.

kafka-python is imported lazily (in the functions that call it), so importing this module, like importing
``runwatch.producer``, loads no Kafka client.
"""

from __future__ import annotations

from typing import Any

from runwatch.contract import topics
from runwatch.contract.schema import EventBase

# The client's record batch per partition (kafka-python's ``batch_size``; its default is 16 KiB, about ten
# step events): one batch of the publisher's is then one produce request, not one per ten events, and the
# client's sender thread spends its ~1 ms of Python per request once per batch. Well under the 1 MB a
# broker takes by default (``message.max.bytes``), so a full batch is never refused for its size.
RECORD_BATCH_BYTES = 256 * 1024
# The client's own wait for more records before it sends (kafka-python's ``linger_ms``): none, since this
# publisher hands it a whole batch at once. A linger on top delayed every batch by it and, measured on a
# loaded 2-core VM (docs/profiles/trainer.md), split a batch into two produce requests as often as not.
DEFAULT_LINGER_MS = 0


def producer_config(
    run_id: str, rank: int, bootstrap: str, *, max_block_ms: int, linger_ms: int, delivery_timeout_ms: int
) -> dict[str, Any]:
    """``KafkaProducer``'s keyword arguments for one rank's delivery."""
    return dict(
        bootstrap_servers=bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        max_block_ms=max_block_ms,
        linger_ms=linger_ms,
        batch_size=RECORD_BATCH_BYTES,
        acks=1,
        # One request in flight per connection: a retried batch can never land behind a later
        # one, so each rank's events arrive in the order sent (the join and rank 0's run_start,
        # which tells the worker the world size, rely on it). acks=1 turns idempotence off, and
        # with it kafka-python's own ordering guarantee.
        max_in_flight_requests_per_connection=1,
        # Per-request sensors cost more host time than the send itself; nothing reads them.
        metrics_enabled=False,
        # Short, so that a dead broker hands events to the spool within seconds and the
        # client's own buffer (rate x delivery timeout) stays small.
        delivery_timeout_ms=delivery_timeout_ms,
        request_timeout_ms=max(500, (delivery_timeout_ms - linger_ms) // 2),
        reconnect_backoff_max_ms=1000,
        client_id=f"runwatch-{run_id}-r{rank}",
    )


class RecordPlacement:
    """Where one rank's records go: ``topic``, keyed by ``key``, and the partition ``send`` is told."""

    def __init__(self, topic: str, key: bytes) -> None:
        self.topic = topic
        self.key = key
        self._partition_cache: dict[
            frozenset[int], int
        ] = {}  # the key's partition, by the topic's partitions

    def placed(self, producer: Any) -> dict[str, int]:
        """``send``'s partition argument, worked out once per batch rather than by the client per record: a
        split run's group key goes to its group's partition (``topics.key_partition``), which the client's
        murmur2 partitioner does not know; any other key to the partition that partitioner would pick
        (``keyed_partition``, the same murmur2 of the same key). Empty (the client picks) until the
        client has the topic's partitions, or without a client. Raises what the client raises when it gets
        no metadata within ``max_block_ms``."""
        if producer is None:
            return {}
        partitions = producer.partitions_for(self.topic)  # (the client's cached metadata once it has it)
        if not partitions:
            return {}
        if b"#" in self.key:
            partition = topics.group_partition(self.key, len(partitions))
        else:
            partition = self._partition_cache.get(frozenset(partitions))
            if partition is None:
                partition = keyed_partition(self.key, partitions)
                self._partition_cache = {frozenset(partitions): partition}
        return {} if partition is None else {"partition": partition}


def keyed_partition(key: bytes, partitions: set[int] | frozenset[int]) -> int:
    """The partition kafka-python's default partitioner gives ``key`` among ``partitions`` (the Java client's
    murmur2, as every Kafka client keys records): what ``send`` picks per record, computed once."""
    from kafka.partitioner.default import murmur2

    ordered = sorted(partitions)
    index: int = (murmur2(key) & 0x7FFFFFFF) % len(ordered)
    return ordered[index]


def rejected(exc: BaseException) -> bool:
    """The broker or client refuses this record for what it is: sending it again cannot help."""
    from kafka import errors

    return isinstance(
        exc,
        (
            errors.MessageSizeTooLargeError,
            errors.RecordListTooLargeError,
            errors.CorruptRecordError,
            errors.InvalidRecordError,
            errors.UnsupportedForMessageFormatError,
        ),
    )


def serialised(events: list[EventBase]) -> list[tuple[bytes, int | None]]:
    """Each event's record value and timestamp, the whole batch in one pass."""
    return [(event.to_json(), timestamp_ms(event)) for event in events]


def timestamp_ms(event: EventBase) -> int | None:
    """The record's timestamp is the event's own ``ts``: the worker checks ``ts`` against the record
    timestamp, so a run on a simulated clock (the demo's scenarios) stays consistent with itself.
    A replayed spool record is stamped at its replay instead (its ``ts`` is then in the past,
    within the worker's allowance)."""
    try:
        return int(event.ts.timestamp() * 1000)
    except (OverflowError, ValueError, OSError):
        return None
