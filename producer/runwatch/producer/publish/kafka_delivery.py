"""``KafkaDelivery``: a ``RunWatch``'s events to the telemetry topic, never blocking training.

Every event is a non-blocking put on a bounded in-memory queue; a daemon thread
serialises and hands events to kafka-python. The training loop never waits on the
network and never sees an exception from it.

When the broker does not take an event (no metadata within ``max_block_ms``, or no
acknowledgement within ``delivery_timeout_ms``), the event goes to a bounded on-disk
spool (:class:`~runwatch.producer.publish.spool.DiskSpool`) instead, and so does every newer
event while the spool holds anything, so order is kept. The same thread probes the
broker with one spooled event at a time, backing off, and once one is acknowledged
replays the spool head first in batches. What the spool's bound refuses or evicts,
and what cannot be queued, is dropped and counted in ``stats``.

The parts: this module's publisher thread (the queue, batches, direct sends, spooling mode's turns,
shutdown); the client's settings, partitions and record values (kafka_client.py); the books the three
threads keep (delivery_books.py); the spool's side, handoff and replay (spool_replay.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runwatch.contract import topics
from runwatch.contract.schema import EventBase
from runwatch.producer.publish.delivery_books import DeliveryBooks
from runwatch.producer.publish.events import PendingEvent
from runwatch.producer.publish.kafka_client import (
    DEFAULT_LINGER_MS,
    RecordPlacement,
    producer_config,
    serialised,
)
from runwatch.producer.publish.spool import HEADER_BYTES, OVERFLOW_POLICIES, Overflow
from runwatch.producer.publish.spool_replay import SpoolReplay

log = logging.getLogger(__name__)

SPOOL_DIR_ENV = "RUNWATCH_SPOOL_DIR"
DEFAULT_SPOOL_BASE = Path(".runwatch") / "spool"
DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024

_APPEND_PER_TURN = 1000
# With nothing queued the publisher thread looks again after this long (an event wakes it sooner).
DRAIN_INTERVAL_S = 0.1
# Events go out in batches at most this often (each produce request costs kafka-python's sender about
# 1.5 ms of Python under the GIL, whatever it holds); the first event after a quieter spell goes at once.
DEFAULT_BATCH_INTERVAL_S = 0.1


def default_spool_dir(run_id: str, rank: int) -> Path:
    """``$RUNWATCH_SPOOL_DIR`` (default ``.runwatch/spool``) ``/<run_id>-r<rank>``, absolute."""
    base = Path(os.environ.get(SPOOL_DIR_ENV) or DEFAULT_SPOOL_BASE)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    if name != run_id:  # keep two run ids that differ only in odd characters apart
        name += "-" + hashlib.sha1(run_id.encode()).hexdigest()[:8]
    return (base / f"{name}-r{rank}").resolve()


class KafkaDelivery:
    """Sends one rank's events to ``topic`` at ``bootstrap``, keyed by ``run_id``.

    Construction returns immediately whether or not a broker is reachable. Events the broker
    does not take go to a disk spool at ``spool_path`` (``None``: no spool, and then they are
    dropped), bounded by ``spool_max_bytes``; past the bound ``spool_overflow`` drops the newest
    or the oldest events. A delivery started with the same spool directory (a restarted run)
    replays what an earlier process left there. Events are sent in batches at most every
    ``batch_interval_s`` (0: each as soon as the thread wakes); an event after a quieter spell goes at once.
    """

    def __init__(
        self,
        run_id: str,
        rank: int,
        bootstrap: str,
        *,
        topic: str = topics.TELEMETRY,
        queue_size: int = 10_000,
        max_block_ms: int = 100,
        linger_ms: int = DEFAULT_LINGER_MS,
        delivery_timeout_ms: int = 3000,
        spool_path: Path | None = None,
        spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES,
        spool_overflow: Overflow = "drop_newest",
        batch_interval_s: float = DEFAULT_BATCH_INTERVAL_S,
        key: bytes | None = None,
    ):
        if not 0 <= batch_interval_s <= 10:
            raise ValueError(f"batch_interval_s must be between 0 and 10 seconds, not {batch_interval_s!r}")
        if spool_overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"spool_overflow must be one of {', '.join(OVERFLOW_POLICIES)}")
        if spool_max_bytes <= HEADER_BYTES:
            raise ValueError(f"spool_max_bytes must exceed {HEADER_BYTES}")
        self.bootstrap = bootstrap
        self.topic = topic
        self.spool_path = spool_path
        self._key = key if key is not None else run_id.encode()  # (a split run's rank: its group's key)
        # The books the training loop, this delivery's thread and the client's sender thread keep
        self._books = DeliveryBooks(spool_usable=spool_path is not None)
        self.stats = self._books.stats
        self._lock = self._books.lock
        # A deque (append and popleft are atomic) and a wake-up flag: the drain thread takes everything
        # queued at each wake, so a burst of events goes out as one batch.
        self._queue: deque[EventBase | PendingEvent] = deque()  # (a PendingEvent is validated when taken)
        self._warned_invalid = False
        self._wake = threading.Event()
        self._queue_size = queue_size
        self._batch_interval_s = batch_interval_s
        self._last_batch = float("-inf")  # when the latest batch was handed to the client (monotonic)
        self._closing = threading.Event()
        self._close_deadline = float("inf")
        # The drain thread's own state:
        self._placement = RecordPlacement(topic, self._key)
        self._spooler = SpoolReplay(
            self._books, self._placement, spool_path, spool_max_bytes, spool_overflow, bootstrap
        )
        self._spooling = False  # new events go to the spool tail (it holds something)
        self._delivery_timeout_s = delivery_timeout_ms / 1000
        self._producer_config = producer_config(
            run_id,
            rank,
            bootstrap,
            max_block_ms=max_block_ms,
            linger_ms=linger_ms,
            delivery_timeout_ms=delivery_timeout_ms,
        )
        self._thread = threading.Thread(target=self._drain, name="runwatch-publisher", daemon=True)
        self._thread.start()

    # -- what RunWatch calls ------------------------------------------------------------

    def deliver(self, event: EventBase) -> bool:
        """Queue one event; never blocks. Returns False if it was dropped."""
        if len(self._queue) >= self._queue_size:
            self._books.count_drop("queue_full", after_queue=False)
            return False
        self._queue.append(event)
        self._wake.set()
        with self._lock:
            self.stats.queued += 1
        return True

    def deliver_later(self, pending: PendingEvent) -> bool:
        """Queue one event to be validated by the publisher thread (``RunWatch.queue_step``); never blocks.
        Returns False if it was dropped (queue full); one that does not validate is counted ``invalid``."""
        if len(self._queue) >= self._queue_size:
            self._books.count_drop("queue_full", after_queue=False)
            return False
        self._queue.append(pending)
        if not self._wake.is_set():
            self._wake.set()
        with self._lock:
            self.stats.queued += 1
        return True

    def refuse(self, reason: str) -> None:
        self._books.count_drop(reason, after_queue=False)

    def _built(self, item: EventBase | PendingEvent) -> EventBase | None:
        """A queued event as the event it is: a pending one validated here (None, and counted ``invalid``,
        when it does not validate: a bad value must not end the run, nor this thread)."""
        if not isinstance(item, PendingEvent):
            return item
        try:
            return item.build()
        except ValidationError as exc:
            self._books.count_drop("invalid")
            if not self._warned_invalid:
                self._warned_invalid = True
                log.warning(
                    "runwatch: dropped an invalid %s event (further ones are only counted): %s",
                    item.model.__name__,
                    exc,
                )
            return None

    def _pop(self) -> EventBase | None:
        return self._built(self._queue.popleft())

    def close(self, timeout: float) -> None:
        """Deliver what is queued or spooled within ``timeout``, then stop. Every event offered (or
        recovered from the spool) is then exactly one of ``published``, ``dropped`` or
        ``spooled_at_close`` (on disk, replayed next time)."""
        if self._closing.is_set():
            return
        self._close_deadline = time.monotonic() + timeout
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout + 5.0)
        unaccounted = self._books.close()
        if unaccounted > 0:
            self._books.count_drop("undelivered_at_close", unaccounted)

    def delivered_offsets(self) -> dict[int, int]:
        """Highest broker-acknowledged offset per partition of the telemetry topic."""
        with self._lock:
            return dict(self._books.offsets)

    # -- the drain thread -------------------------------------------------------------------

    def _make_producer(self) -> Any:
        from kafka import KafkaProducer

        return KafkaProducer(**self._producer_config)

    def _await_metadata(self, producer: Any) -> None:
        """Fetch the topic's metadata before the first send. A fresh client on a busy host can take
        longer than ``max_block_ms`` to get it, and then the first events fail: rank 0's
        ``run_start`` (which tells the worker the world size) would be spooled, or dropped where
        there is no spool. So this thread waits for it, up to the delivery timeout; events queue
        meanwhile and training never waits."""
        deadline = time.monotonic() + self._delivery_timeout_s
        while (
            producer is not None
            and time.monotonic() < deadline
            and not (self._closing.is_set() and time.monotonic() >= self._close_deadline)
        ):
            try:
                producer.partitions_for(self.topic)  # waits up to max_block_ms
                return
            except Exception:  # noqa: BLE001 - no broker yet: try again until the deadline, then send
                # (and spool) as usual
                time.sleep(0.05)

    def _drain(self) -> None:
        try:
            producer = self._make_producer()
        except Exception as exc:  # noqa: BLE001 - bad bootstrap string and the like: count, never raise
            log.warning("runwatch: cannot create Kafka producer (%s); events will be spooled or dropped", exc)
            producer = None
        try:
            self._await_metadata(producer)
            if self._spooler.recover():
                self._spooling = True
            self._run(producer)
        except Exception:  # a bug here must not take the training loop down; close() counts the rest
            log.exception("runwatch: publisher thread failed")
        finally:
            self._shutdown(producer)

    def _run(self, producer: Any) -> None:
        transition_since: float | None = None
        books = self._books
        while True:
            now = time.monotonic()
            closing = self._closing.is_set()
            if closing and now >= self._close_deadline:
                return  # what is left is spooled (or counted undelivered) by _shutdown / close()
            with books.lock:
                failed, inflight = bool(books.failed), len(books.inflight)
            if failed and not self._spooling and transition_since is None:
                transition_since = now
                log.warning(
                    "runwatch: broker %s is not taking events; spooling them to %s",
                    self.bootstrap,
                    self.spool_path,
                )
            if transition_since is not None:
                # Let the client resolve what it still holds (it fails in send order) before
                # anything newer is spooled, so the spool keeps the events' order.
                if inflight > 0 and now - transition_since < self._delivery_timeout_s + 5.0:
                    time.sleep(0.01)
                    continue
                transition_since = None
                self._spooling = self._spooler.absorb_failures()
            if self._spooling:
                if self._spool_turn(producer, closing):
                    return
                continue
            events = self._take_batch()
            if not events:
                if closing:
                    return  # in-flight sends are flushed (and failures spooled) by _shutdown
                continue
            self._send_batch(producer, events)

    def _send_batch(self, producer: Any, events: list[EventBase]) -> None:
        """Send ``events`` in order. Stop at the first failure (the broker is not taking events: the rest go
        back to the front of the queue, which spooling mode then takes) or at close()'s deadline (then
        _shutdown spools them), so a broker that is down costs one ``max_block_ms`` per batch, not one
        per event (a batch of 200 would hold close() for 40 s and lose the events it could not spool).

        The batch is serialised first, in one pass, and then handed to the client in a tight loop, so that
        its records go out in one produce request (serialising between sends let the client send a few
        records at a time)."""
        values = serialised(events)
        books = self._books
        try:
            placed = self._placement.placed(producer)
        except Exception as exc:  # noqa: BLE001 - no metadata within max_block_ms: the first event fails as
            # its send would have (the rest go back to the queue for spooling mode), one wait per batch
            self._queue.extendleft(reversed(events[1:]))
            books.send_failed(values[0][0], exc)
            return
        for i, (value, timestamp_ms) in enumerate(values):
            with books.lock:
                failed = bool(books.failed)
            if failed or (self._closing.is_set() and time.monotonic() >= self._close_deadline):
                self._queue.extendleft(reversed(events[i:]))
                return
            self._send_direct(producer, value, timestamp_ms, placed)

    def _send_direct(
        self, producer: Any, value: bytes, timestamp_ms: int | None, placed: dict[str, int]
    ) -> None:
        books = self._books
        if producer is None:
            books.send_failed(value, RuntimeError("no Kafka producer"))
            return
        seq = books.track(value)
        try:
            future = producer.send(
                self.topic, key=self._key, value=value, timestamp_ms=timestamp_ms, **placed
            )
        except Exception as exc:  # noqa: BLE001 - e.g. KafkaTimeoutError when no broker answers
            # within max_block_ms
            books.on_failed(seq, exc)
            return
        future.add_callback(books.on_sent, seq)
        future.add_errback(books.on_failed, seq)

    def _spool_turn(self, producer: Any, closing: bool) -> bool:
        """One turn of spooling mode; True when a closing publisher has nothing left to do."""
        spooler = self._spooler
        spooler.absorb_failures()
        for _ in range(_APPEND_PER_TURN):
            if not self._queue:
                break
            event = self._pop()
            if event is not None:
                spooler.spool_event(event)
        spool = spooler.spool
        if spooler.replay is not None:
            if not spooler.replay.done():  # a probe of a dead broker may take delivery_timeout_ms
                self._wait_for_event(0.05 if spooler.broker_down else 0.01)
                return False
            spooler.finish_replay()
        if spool is None or len(spool) == 0:
            self._spooling = False
            spooler.broker_down = False
            return False
        if producer is None:
            if closing and not self._queue:
                return True
            self._wait_for_event(0.05)
            return False
        wait = spooler.next_probe - time.monotonic()
        if wait > 0:
            self._wait_for_event(min(wait, 0.05))
            return False
        spooler.start_replay(producer)
        return False

    def _wait_for_event(self, timeout: float) -> None:
        for event in self._take(timeout):
            self._spooler.spool_event(event)

    def _take_batch(self) -> list[EventBase]:
        """The next batch to send: everything queued, no sooner than ``batch_interval_s`` after the
        previous batch (close() cuts the wait short), so a fast loop's events share produce requests."""
        events = self._take(DRAIN_INTERVAL_S)
        if not events:
            return events
        hold = self._last_batch + self._batch_interval_s - time.monotonic()
        if hold > 0:
            self._closing.wait(hold)
            events += self._take(0)
        self._last_batch = time.monotonic()
        return events

    def _take(self, timeout: float) -> list[EventBase]:
        """Everything queued; when nothing is, wait up to ``timeout`` first (close() cuts the wait short)."""
        if not self._queue:
            if self._closing.is_set():
                time.sleep(timeout)
            else:
                self._wake.wait(timeout)
        self._wake.clear()
        queued, built = self._queue, self._built
        events = [built(queued.popleft()) for _ in range(len(queued))]
        return [e for e in events if e is not None]

    def _shutdown(self, producer: Any) -> None:
        if producer is not None:
            try:  # the loop only ends once close() has set the deadline (or on a bug)
                producer.flush(timeout=max(0.1, self._close_deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - a best-effort flush at shutdown
                log.debug("runwatch: flush failed: %r", exc)
            try:
                producer.close(timeout=1.0)
            except Exception:  # noqa: BLE001 - kafka-python's close raises when its flush times out,
                # leaving its sender thread running; stop that thread the way close() would have
                try:
                    producer._sender.force_close()
                except Exception:  # noqa: BLE001 - a best-effort stop
                    pass
        spooler = self._spooler
        try:
            if spooler.replay is not None:
                spooler.finish_replay()  # unresolved replay sends count as failed: they stay spooled
            if self._books.spool_usable and self.spool_path is not None:
                self._books.fail_inflight()
                spooler.absorb_failures()
                while self._queue:
                    event = self._pop()
                    if event is not None:
                        spooler.spool_event(event)
        except Exception:
            log.exception("runwatch: could not spool what was left at close")
        spooler.close()
