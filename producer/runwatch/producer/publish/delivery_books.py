"""``DeliveryBooks``: what became of every event a ``KafkaDelivery`` was offered, kept under one lock.

Three threads write them: the training loop (queued, dropped because the queue is full), the publisher
thread (spooled, replayed, dropped for a reason) and kafka-python's sender thread, whose callbacks resolve
the direct sends (acknowledged: published; failed: back to the publisher thread for the spool, or dropped
when there is none or the broker refuses the record for good). Once the delivery has closed, the books
are final: a stuck client's late callbacks change nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from runwatch.producer.publish.delivery import PublisherStats
from runwatch.producer.publish.kafka_client import rejected

# The delivery's messages keep its logger, wherever their code sits: users filter on its name.
log = logging.getLogger("runwatch.producer.publish.kafka_delivery")


class DeliveryBooks:
    """``stats`` and the direct sends still in flight, under ``lock``. ``spool_usable``: whether a failed
    send can go to the spool (False without one, or once opening it failed)."""

    def __init__(self, spool_usable: bool) -> None:
        self.lock = threading.Lock()
        self.stats = PublisherStats()
        self.offsets: dict[int, int] = {}  # partition -> highest acknowledged offset
        self.dropped_after_queue = 0  # queued (or recovered) events counted as dropped
        self.final = False
        # Shared with kafka-python's sender thread (under lock):
        self.inflight: dict[int, bytes] = {}  # sequence -> value sent straight to the client, unresolved
        self.failed: list[tuple[int, bytes]] = []  # (sequence, value) of direct sends that failed
        self.spool_usable = spool_usable
        self._seq = 0  # (the publisher thread's alone)

    def count_drop(self, reason: str, n: int = 1, *, after_queue: bool = True) -> None:
        with self.lock:
            self.stats.dropped += n
            self.stats.drop_reasons[reason] = self.stats.drop_reasons.get(reason, 0) + n
            if after_queue:
                self.dropped_after_queue += n

    def acknowledged(self, metadata: Any) -> None:  # under lock
        if metadata.offset > self.offsets.get(metadata.partition, -1):
            self.offsets[metadata.partition] = metadata.offset

    def track(self, value: bytes) -> int:
        """A direct send's sequence number, its value held until the broker acknowledges it (or it fails)."""
        self._seq += 1
        seq = self._seq
        with self.lock:
            self.inflight[seq] = value
        return seq

    def send_failed(self, value: bytes, exc: BaseException) -> None:
        """A direct send that failed before reaching the client: booked as the client's failures are."""
        self.on_failed(self.track(value), exc)

    # -- kafka-python's sender thread -----------------------------------------------------

    def on_sent(self, seq: int, metadata: Any) -> None:
        with self.lock:
            if self.inflight.pop(seq, None) is None or self.final:
                return  # spooled at close already (it will be a duplicate) or the books are closed
            self.stats.published += 1
            self.acknowledged(metadata)

    def on_failed(self, seq: int, exc: BaseException) -> None:
        log.debug("runwatch: send failed: %r", exc)
        with self.lock:
            value = self.inflight.pop(seq, None)
            if value is None or self.final:
                return
            if self.spool_usable and not rejected(exc):
                self.failed.append((seq, value))  # the publisher thread spools it, in order
                return
        self.count_drop("rejected" if rejected(exc) else "send_failed")

    # -- the publisher thread --------------------------------------------------------------

    def take_failed(self) -> list[tuple[int, bytes]]:
        """The failed direct sends, oldest first, handed over to be spooled."""
        with self.lock:
            failed, self.failed = sorted(self.failed, key=lambda f: f[0]), []
        return failed

    def fail_inflight(self) -> None:
        """At close: the direct sends still unresolved count as failed (spooled: a late delivery of one is a
        duplicate)."""
        with self.lock:
            self.failed.extend(self.inflight.items())
            self.inflight.clear()

    def close(self) -> int:
        """Makes the books final; the events offered (or recovered from the spool) that are none of
        published, dropped or spooled at close."""
        with self.lock:
            self.final = True  # late callbacks from a stuck client must not change the books
            s = self.stats
            return s.queued + s.spool_recovered - s.published - self.dropped_after_queue - s.spooled_at_close
