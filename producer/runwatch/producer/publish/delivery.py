"""Where a ``RunWatch``'s events go: the ``Delivery`` protocol and the books every delivery keeps.

:class:`~runwatch.producer.publish.kafka_delivery.KafkaDelivery` sends them to the telemetry topic
(spooling to disk while the broker is away); :class:`~runwatch.producer.publish.recorder.JsonlDelivery`
writes them to a JSONL file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from runwatch.contract.schema import EventBase


@dataclass
class PublisherStats:
    """Counts of what happened to the events of one ``RunWatch``.

    After ``close()``: ``offered + spool_recovered == published + dropped + spooled_at_close``,
    where offered is every event handed to ``publish`` (``queued`` plus the ones dropped
    before queueing: ``queue_full``, ``closed``, ``invalid``).
    """

    queued: int = 0
    # distinct events acknowledged by the broker (replayed ones included); JSONL: lines written
    published: int = 0
    dropped: int = 0  # never reached the broker and are not in the spool; by reason in drop_reasons
    drop_reasons: dict[str, int] = field(default_factory=dict)
    spooled: int = 0  # events written to the disk spool because the broker did not take them
    replayed: int = 0  # events sent from the spool and acknowledged (also counted in published)
    # refused (drop_newest) or evicted (drop_oldest) by the spool's bound; in dropped too
    spool_dropped: int = 0
    spool_recovered: int = 0  # events found in the spool at start, left there by an earlier process
    spooled_at_close: int = 0  # still in the spool after close(): not lost, the next RunWatch replays them
    spool_bytes: int = 0  # live bytes in the spool now
    # acknowledged events that stayed spooled (an earlier one failed) and are sent again
    duplicates_sent: int = 0


class Delivery(Protocol):
    """Takes a ``RunWatch``'s events. Neither ``deliver`` nor ``refuse`` blocks the training loop
    or raises into it; ``stats`` keeps the books (see :class:`PublisherStats`)."""

    stats: PublisherStats

    def deliver(self, event: EventBase) -> bool:
        """Take one event; False if it was dropped (and counted)."""
        ...

    def refuse(self, reason: str) -> None:
        """Count an event dropped before it reached the delivery (``invalid``, ``closed``)."""
        ...

    def close(self, timeout: float) -> None:
        """Deliver what is held within ``timeout`` seconds and stop; the books are final after it."""
        ...


class MemoryDelivery:
    """Keeps the events in ``events``, in order: for tests of code that publishes (``RunWatch(...,
    delivery=MemoryDelivery())``), with no broker and no file."""

    def __init__(self) -> None:
        self.events: list[EventBase] = []
        self.stats = PublisherStats()

    def deliver(self, event: EventBase) -> bool:
        self.events.append(event)
        self.stats.queued += 1  # kept at once: queued and published together, as the JSONL recorder counts
        self.stats.published += 1
        return True

    def refuse(self, reason: str) -> None:
        self.stats.dropped += 1
        self.stats.drop_reasons[reason] = self.stats.drop_reasons.get(reason, 0) + 1

    def close(self, timeout: float) -> None:
        """Nothing is held: every event was kept when delivered."""
