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
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runwatch.contract import topics
from runwatch.contract.schema import EventBase
from runwatch.producer.publish.delivery import PublisherStats
from runwatch.producer.publish.events import PendingEvent
from runwatch.producer.publish.spool import HEADER_BYTES, OVERFLOW_POLICIES, DiskSpool, Overflow

log = logging.getLogger(__name__)

SPOOL_DIR_ENV = "RUNWATCH_SPOOL_DIR"
DEFAULT_SPOOL_BASE = Path(".runwatch") / "spool"
DEFAULT_SPOOL_MAX_BYTES = 256 * 1024 * 1024

_REPLAY_RECORDS = 500  # per replay batch once the broker answers
_REPLAY_BYTES = 1 << 20
_PROBE_BACKOFF_S = (0.2, 2.0)  # first and longest wait between probes of a broker that is down
_APPEND_PER_TURN = 1000
# With nothing queued the publisher thread looks again after this long (an event wakes it sooner).
DRAIN_INTERVAL_S = 0.1
# Events go out in batches at most this often (each produce request costs kafka-python's sender about
# 1.5 ms of Python under the GIL, whatever it holds); the first event after a quieter spell goes at once.
DEFAULT_BATCH_INTERVAL_S = 0.1
# The client's record batch per partition (kafka-python's ``batch_size``; its default is 16 KiB, about ten
# step events): one batch of the publisher's is then one produce request, not one per ten events, and the
# client's sender thread spends its ~1 ms of Python per request once per batch. Well under the 1 MB a
# broker takes by default (``message.max.bytes``), so a full batch is never refused for its size.
RECORD_BATCH_BYTES = 256 * 1024
# The client's own wait for more records before it sends (kafka-python's ``linger_ms``): none, since this
# publisher hands it a whole batch at once. A linger on top delayed every batch by it and, measured on a
# loaded 2-core VM (docs/profiles/trainer.md), split a batch into two produce requests as often as not.
DEFAULT_LINGER_MS = 0


@dataclass
class _Replay:
    first: int  # spool index of the first record in the batch
    futures: list[Any]  # per record sent: kafka-python's future, or _REJECTED
    send_error: bool  # a send raised (no metadata): the records after it were not sent

    def done(self) -> bool:
        return all(f is _REJECTED or f.is_done for f in self.futures)


_REJECTED = object()


def _rejected(exc: BaseException) -> bool:
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
        self.stats = PublisherStats()
        self.spool_path = spool_path
        self._spool_max_bytes = spool_max_bytes
        self._spool_overflow: Overflow = spool_overflow
        self._key = key if key is not None else run_id.encode()  # (a split run's rank: its group's key)
        # A deque (append and popleft are atomic) and a wake-up flag: the drain thread takes everything
        # queued at each wake, so a burst of events goes out as one batch.
        self._queue: deque[EventBase | PendingEvent] = deque()  # (a PendingEvent is validated when taken)
        self._warned_invalid = False
        self._wake = threading.Event()
        self._queue_size = queue_size
        self._batch_interval_s = batch_interval_s
        self._last_batch = float("-inf")  # when the latest batch was handed to the client (monotonic)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._offsets: dict[int, int] = {}  # partition -> highest acknowledged offset
        self._dropped_after_queue = 0  # queued (or recovered) events counted as dropped
        self._close_deadline = float("inf")
        self._final = False
        # Shared with kafka-python's sender thread (under _lock):
        self._inflight: dict[int, bytes] = {}  # sequence -> value sent straight to the client, unresolved
        self._failed: list[tuple[int, bytes]] = []  # (sequence, value) of direct sends that failed
        self._spool_usable = spool_path is not None  # False once opening the spool failed
        # The drain thread's own state:
        self._spool: DiskSpool | None = None
        self._spooling = False  # new events go to the spool tail (it holds something)
        self._replay: _Replay | None = None
        self._broker_down = False
        self._backoff = _PROBE_BACKOFF_S[0]
        self._next_probe = 0.0
        self._seq = 0
        self._partition_cache: dict[
            frozenset[int], int
        ] = {}  # the key's partition, by the topic's partitions
        self._delivery_timeout_s = delivery_timeout_ms / 1000
        self._producer_config = dict(
            bootstrap_servers=self.bootstrap,
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
        self._thread = threading.Thread(target=self._drain, name="runwatch-publisher", daemon=True)
        self._thread.start()

    # -- what RunWatch calls ------------------------------------------------------------

    def deliver(self, event: EventBase) -> bool:
        """Queue one event; never blocks. Returns False if it was dropped."""
        if len(self._queue) >= self._queue_size:
            self._count_drop("queue_full", after_queue=False)
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
            self._count_drop("queue_full", after_queue=False)
            return False
        self._queue.append(pending)
        if not self._wake.is_set():
            self._wake.set()
        with self._lock:
            self.stats.queued += 1
        return True

    def refuse(self, reason: str) -> None:
        self._count_drop(reason, after_queue=False)

    def _built(self, item: EventBase | PendingEvent) -> EventBase | None:
        """A queued event as the event it is: a pending one validated here (None, and counted ``invalid``,
        when it does not validate: a bad value must not end the run, nor this thread)."""
        if not isinstance(item, PendingEvent):
            return item
        try:
            return item.build()
        except ValidationError as exc:
            self._count_drop("invalid")
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
        with self._lock:
            self._final = True  # late callbacks from a stuck client must not change the books
            s = self.stats
            unaccounted = (
                s.queued + s.spool_recovered - s.published - self._dropped_after_queue - s.spooled_at_close
            )
        if unaccounted > 0:
            self._count_drop("undelivered_at_close", unaccounted)

    def delivered_offsets(self) -> dict[int, int]:
        """Highest broker-acknowledged offset per partition of the telemetry topic."""
        with self._lock:
            return dict(self._offsets)

    # -- books ------------------------------------------------------------------------

    def _count_drop(self, reason: str, n: int = 1, *, after_queue: bool = True) -> None:
        with self._lock:
            self.stats.dropped += n
            self.stats.drop_reasons[reason] = self.stats.drop_reasons.get(reason, 0) + n
            if after_queue:
                self._dropped_after_queue += n

    def _acknowledged(self, metadata: Any) -> None:  # under _lock
        if metadata.offset > self._offsets.get(metadata.partition, -1):
            self._offsets[metadata.partition] = metadata.offset

    # -- kafka-python's sender thread -----------------------------------------------------

    def _on_sent(self, seq: int, metadata: Any) -> None:
        with self._lock:
            if self._inflight.pop(seq, None) is None or self._final:
                return  # spooled at close already (it will be a duplicate) or the books are closed
            self.stats.published += 1
            self._acknowledged(metadata)

    def _on_failed(self, seq: int, exc: BaseException) -> None:
        log.debug("runwatch: send failed: %r", exc)
        with self._lock:
            value = self._inflight.pop(seq, None)
            if value is None or self._final:
                return
            if self._spool_usable and not _rejected(exc):
                self._failed.append((seq, value))  # the drain thread spools it, in order
                return
        self._count_drop("rejected" if _rejected(exc) else "send_failed")

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
            self._recover_spool()
            self._run(producer)
        except Exception:  # a bug here must not take the training loop down; close() counts the rest
            log.exception("runwatch: publisher thread failed")
        finally:
            self._shutdown(producer)

    def _run(self, producer: Any) -> None:
        transition_since: float | None = None
        while True:
            now = time.monotonic()
            closing = self._closing.is_set()
            if closing and now >= self._close_deadline:
                return  # what is left is spooled (or counted undelivered) by _shutdown / close()
            with self._lock:
                failed, inflight = bool(self._failed), len(self._inflight)
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
                self._spooling = self._absorb_failures()
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
        values = _serialised(events)
        try:
            placed = self._placed(producer)
        except Exception as exc:  # noqa: BLE001 - no metadata within max_block_ms: the first event fails as
            # its send would have (the rest go back to the queue for spooling mode), one wait per batch
            self._queue.extendleft(reversed(events[1:]))
            self._send_failed(values[0][0], exc)
            return
        for i, (value, timestamp_ms) in enumerate(values):
            with self._lock:
                failed = bool(self._failed)
            if failed or (self._closing.is_set() and time.monotonic() >= self._close_deadline):
                self._queue.extendleft(reversed(events[i:]))
                return
            self._send_direct(producer, value, timestamp_ms, placed)

    def _placed(self, producer: Any) -> dict[str, int]:
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
        if b"#" in self._key:
            partition = topics.group_partition(self._key, len(partitions))
        else:
            partition = self._partition_cache.get(frozenset(partitions))
            if partition is None:
                partition = keyed_partition(self._key, partitions)
                self._partition_cache = {frozenset(partitions): partition}
        return {} if partition is None else {"partition": partition}

    def _send_direct(
        self, producer: Any, value: bytes, timestamp_ms: int | None, placed: dict[str, int]
    ) -> None:
        if producer is None:
            self._send_failed(value, RuntimeError("no Kafka producer"))
            return
        seq = self._track(value)
        try:
            future = producer.send(
                self.topic, key=self._key, value=value, timestamp_ms=timestamp_ms, **placed
            )
        except Exception as exc:  # noqa: BLE001 - e.g. KafkaTimeoutError when no broker answers
            # within max_block_ms
            self._on_failed(seq, exc)
            return
        future.add_callback(self._on_sent, seq)
        future.add_errback(self._on_failed, seq)

    def _track(self, value: bytes) -> int:
        """A direct send's sequence number, its value held until the broker acknowledges it (or it fails)."""
        self._seq += 1
        seq = self._seq
        with self._lock:
            self._inflight[seq] = value
        return seq

    def _send_failed(self, value: bytes, exc: BaseException) -> None:
        """A direct send that failed before reaching the client: booked as the client's failures are."""
        self._on_failed(self._track(value), exc)

    def _spool_turn(self, producer: Any, closing: bool) -> bool:
        """One turn of spooling mode; True when a closing publisher has nothing left to do."""
        self._absorb_failures()
        for _ in range(_APPEND_PER_TURN):
            if not self._queue:
                break
            event = self._pop()
            if event is not None:
                self._spool_event(event)
        spool = self._spool
        if self._replay is not None:
            if not self._replay.done():  # a probe of a dead broker may take delivery_timeout_ms
                self._wait_for_event(0.05 if self._broker_down else 0.01)
                return False
            self._finish_replay()
        if spool is None or len(spool) == 0:
            self._spooling = False
            self._broker_down = False
            return False
        if producer is None:
            if closing and not self._queue:
                return True
            self._wait_for_event(0.05)
            return False
        wait = self._next_probe - time.monotonic()
        if wait > 0:
            self._wait_for_event(min(wait, 0.05))
            return False
        self._start_replay(producer)
        return False

    def _wait_for_event(self, timeout: float) -> None:
        for event in self._take(timeout):
            self._spool_event(event)

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

    def _start_replay(self, producer: Any) -> None:
        # While the broker is down, probe with the oldest record alone.
        assert self._spool is not None
        first, records = self._spool.peek(1 if self._broker_down else _REPLAY_RECORDS, _REPLAY_BYTES)
        futures: list[Any] = []
        send_error = False
        try:
            placed = self._placed(producer)
        except Exception as exc:  # noqa: BLE001 - no metadata within max_block_ms
            log.debug("runwatch: replay send failed: %r", exc)
            records, send_error = [], True
        for value in records:
            try:
                futures.append(producer.send(self.topic, key=self._key, value=value, **placed))
            except Exception as exc:  # noqa: BLE001 - no metadata within max_block_ms, or a record too large
                log.debug("runwatch: replay send failed: %r", exc)
                if _rejected(exc):
                    futures.append(_REJECTED)
                    continue
                send_error = True
                break
        self._replay = _Replay(first, futures, send_error)

    def _finish_replay(self) -> None:
        replay, self._replay = self._replay, None
        assert replay is not None and self._spool is not None
        # The records acknowledged (or refused for good) from the head on leave the spool;
        # the first one that failed, and everything after it, stays for the next attempt.
        outcomes: list[bool] = []  # per record of that prefix: True acknowledged, False rejected
        for f in replay.futures:
            if f is _REJECTED or (f.failed() and _rejected(f.exception)):
                outcomes.append(False)
            elif f.succeeded():
                outcomes.append(True)
            else:
                break
        prefix = len(outcomes)
        later = sum(1 for f in replay.futures[prefix:] if f is not _REJECTED and f.succeeded())
        head = self._spool.head_index  # records of the batch below it were evicted meanwhile (and counted)
        try:
            self._spool.commit(replay.first + prefix)
        except OSError as exc:
            log.warning("runwatch: spool commit failed: %s", exc)
            outcomes = []
        kept = outcomes[max(0, head - replay.first) :]
        acknowledged, rejected = kept.count(True), kept.count(False)
        if rejected:
            log.warning("runwatch: the broker refused %d spooled events for good; dropped", rejected)
            self._count_drop("rejected", rejected)
        with self._lock:
            if not self._final:
                self.stats.published += acknowledged
                self.stats.replayed += acknowledged
                self.stats.duplicates_sent += later
                for f in replay.futures:
                    if f is not _REJECTED and f.succeeded():
                        self._acknowledged(f.value)
                self.stats.spool_bytes = self._spool.bytes
        if prefix == len(replay.futures) and not replay.send_error:
            if self._broker_down:
                log.warning(
                    "runwatch: broker %s is back; replaying %d spooled events",
                    self.bootstrap,
                    len(self._spool),
                )
            self._broker_down = False
            self._backoff = _PROBE_BACKOFF_S[0]
            self._next_probe = 0.0
        else:
            self._broker_down = True
            self._next_probe = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, _PROBE_BACKOFF_S[1])

    # -- the spool -------------------------------------------------------------------------

    def _open_spool(self) -> DiskSpool | None:
        if self._spool is None and self._spool_usable and self.spool_path is not None:
            try:
                self._spool = DiskSpool(self.spool_path, self._spool_max_bytes, self._spool_overflow)
            except (OSError, ValueError) as exc:
                log.warning(
                    "runwatch: cannot use the spool at %s (%s); undeliverable events are dropped",
                    self.spool_path,
                    exc,
                )
                with self._lock:
                    self._spool_usable = False
        return self._spool

    def _recover_spool(self) -> None:
        """Replay first what an earlier process left in this run's spool."""
        if self.spool_path is None or not any(self.spool_path.glob("*.seg")):
            return
        spool = self._open_spool()
        if spool is not None and len(spool):
            with self._lock:
                self.stats.spool_recovered = len(spool)
                self.stats.spool_bytes = spool.bytes
            self._spooling = True
            log.warning(
                "runwatch: replaying %d events left in %s by an earlier process", len(spool), self.spool_path
            )

    def _absorb_failures(self) -> bool:
        """Spool the failed direct sends, oldest first; True if the spool holds anything."""
        with self._lock:
            failed, self._failed = sorted(self._failed, key=lambda f: f[0]), []
        if failed:
            self._broker_down = True
            self._next_probe = time.monotonic() + self._backoff
        spool = self._open_spool() if failed else self._spool
        if spool is None:
            if failed:
                self._count_drop("send_failed", len(failed))
            return False
        for _seq, value in failed:
            self._spool_value(value)
        return len(spool) > 0

    def _spool_event(self, event: EventBase) -> None:
        if self._open_spool() is None:
            self._count_drop("send_failed")
            return
        self._spool_value(event.to_json())

    def _spool_value(self, value: bytes) -> None:
        spool = self._spool
        assert spool is not None
        evicted_before = spool.stats.evicted
        try:
            ok = spool.append(value)
        except OSError as exc:  # disk full and the like
            log.warning("runwatch: spool write failed: %s", exc)
            self._count_drop("spool_error")
            return
        evicted = spool.stats.evicted - evicted_before
        if evicted:
            self._count_drop("spool_evicted", evicted)
        if not ok:
            self._count_drop("spool_full")
        with self._lock:
            self.stats.spooled += ok
            self.stats.spool_dropped += evicted + (not ok)
            self.stats.spool_bytes = spool.bytes

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
        try:
            if self._replay is not None:
                self._finish_replay()  # unresolved replay sends count as failed: they stay spooled
            if self._spool_usable and self.spool_path is not None:
                with self._lock:  # unresolved direct sends are spooled too (a late delivery is a duplicate)
                    self._failed.extend(self._inflight.items())
                    self._inflight.clear()
                self._absorb_failures()
                while self._queue:
                    event = self._pop()
                    if event is not None:
                        self._spool_event(event)
        except Exception:
            log.exception("runwatch: could not spool what was left at close")
        spool = self._spool
        if spool is None:
            return
        try:
            spool.close()
            spool.remove_if_empty()
        except OSError as exc:
            log.warning("runwatch: closing the spool at %s failed: %s", self.spool_path, exc)
        with self._lock:
            self.stats.spooled_at_close = len(spool)
            self.stats.spool_bytes = spool.bytes
        if len(spool):
            log.warning(
                "runwatch: %d events stay in %s; a RunWatch with the same run id and rank replays them",
                len(spool),
                self.spool_path,
            )


def keyed_partition(key: bytes, partitions: set[int] | frozenset[int]) -> int:
    """The partition kafka-python's default partitioner gives ``key`` among ``partitions`` (the Java client's
    murmur2, as every Kafka client keys records): what ``send`` picks per record, computed once."""
    from kafka.partitioner.default import murmur2

    ordered = sorted(partitions)
    index: int = (murmur2(key) & 0x7FFFFFFF) % len(ordered)
    return ordered[index]


def _serialised(events: list[EventBase]) -> list[tuple[bytes, int | None]]:
    """Each event's record value and timestamp, the whole batch in one pass."""
    return [(event.to_json(), _timestamp_ms(event)) for event in events]


def _timestamp_ms(event: EventBase) -> int | None:
    """The record's timestamp is the event's own ``ts``: the worker checks ``ts`` against the record
    timestamp, so a run on a simulated clock (the demo's scenarios) stays consistent with itself.
    A replayed spool record is stamped at its replay instead (its ``ts`` is then in the past,
    within the worker's allowance)."""
    try:
        return int(event.ts.timestamp() * 1000)
    except (OverflowError, ValueError, OSError):
        return None
