"""``SpoolReplay``: the events the broker does not take, handed to the disk spool and replayed from it.

``KafkaDelivery``'s publisher thread enters spooling mode when a direct send fails: the failed sends go to
the spool oldest first (:meth:`SpoolReplay.absorb_failures`), and so does every newer event while the
spool holds anything, so order is kept. It probes the broker with one spooled record at a time, backing
off from ``_PROBE_BACKOFF_S[0]`` to ``[1]``; once one is acknowledged it replays the spool head first, in
batches, and commits what the broker acknowledged (or refused for good). All of it runs on the publisher
thread; what it books goes through :class:`~runwatch.producer.publish.delivery_books.DeliveryBooks`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runwatch.contract.schema import EventBase
from runwatch.producer.publish.delivery_books import DeliveryBooks
from runwatch.producer.publish.kafka_client import RecordPlacement, rejected
from runwatch.producer.publish.spool import DiskSpool, Overflow

# The delivery's messages keep its logger, wherever their code sits: users filter on its name.
log = logging.getLogger("runwatch.producer.publish.kafka_delivery")

_REPLAY_RECORDS = 500  # per replay batch once the broker answers
_REPLAY_BYTES = 1 << 20
_PROBE_BACKOFF_S = (0.2, 2.0)  # first and longest wait between probes of a broker that is down


@dataclass
class _Replay:
    first: int  # spool index of the first record in the batch
    futures: list[Any]  # per record sent: kafka-python's future, or _REJECTED
    send_error: bool  # a send raised (no metadata): the records after it were not sent

    def done(self) -> bool:
        return all(f is _REJECTED or f.is_done for f in self.futures)


_REJECTED = object()


class SpoolReplay:
    """The spool at ``spool_path`` (opened when first needed), bounded by ``max_bytes`` with ``overflow``'s
    policy, and the replay of its records to ``placement``'s topic. ``replay``: the batch in flight;
    ``broker_down``: the last probe failed, ``next_probe``: when to probe again (monotonic)."""

    def __init__(
        self,
        books: DeliveryBooks,
        placement: RecordPlacement,
        spool_path: Path | None,
        max_bytes: int,
        overflow: Overflow,
        bootstrap: str,
    ) -> None:
        self._books = books
        self._placement = placement
        self.spool_path = spool_path
        self._max_bytes = max_bytes
        self._overflow: Overflow = overflow
        self._bootstrap = bootstrap
        self.spool: DiskSpool | None = None
        self.replay: _Replay | None = None
        self.broker_down = False
        self._backoff = _PROBE_BACKOFF_S[0]
        self.next_probe = 0.0

    def open(self) -> DiskSpool | None:
        books = self._books
        if self.spool is None and books.spool_usable and self.spool_path is not None:
            try:
                self.spool = DiskSpool(self.spool_path, self._max_bytes, self._overflow)
            except (OSError, ValueError) as exc:
                log.warning(
                    "runwatch: cannot use the spool at %s (%s); undeliverable events are dropped",
                    self.spool_path,
                    exc,
                )
                with books.lock:
                    books.spool_usable = False
        return self.spool

    def recover(self) -> bool:
        """Replay first what an earlier process left in this run's spool; True if it left anything."""
        if self.spool_path is None or not any(self.spool_path.glob("*.seg")):
            return False
        spool = self.open()
        if spool is None or not len(spool):
            return False
        with self._books.lock:
            self._books.stats.spool_recovered = len(spool)
            self._books.stats.spool_bytes = spool.bytes
        log.warning(
            "runwatch: replaying %d events left in %s by an earlier process", len(spool), self.spool_path
        )
        return True

    def absorb_failures(self) -> bool:
        """Spool the failed direct sends, oldest first; True if the spool holds anything."""
        failed = self._books.take_failed()
        if failed:
            self.broker_down = True
            self.next_probe = time.monotonic() + self._backoff
        spool = self.open() if failed else self.spool
        if spool is None:
            if failed:
                self._books.count_drop("send_failed", len(failed))
            return False
        for _seq, value in failed:
            self.spool_value(value)
        return len(spool) > 0

    def spool_event(self, event: EventBase) -> None:
        if self.open() is None:
            self._books.count_drop("send_failed")
            return
        self.spool_value(event.to_json())

    def spool_value(self, value: bytes) -> None:
        spool, books = self.spool, self._books
        assert spool is not None
        evicted_before = spool.stats.evicted
        try:
            ok = spool.append(value)
        except OSError as exc:  # disk full and the like
            log.warning("runwatch: spool write failed: %s", exc)
            books.count_drop("spool_error")
            return
        evicted = spool.stats.evicted - evicted_before
        if evicted:
            books.count_drop("spool_evicted", evicted)
        if not ok:
            books.count_drop("spool_full")
        with books.lock:
            books.stats.spooled += ok
            books.stats.spool_dropped += evicted + (not ok)
            books.stats.spool_bytes = spool.bytes

    def start_replay(self, producer: Any) -> None:
        # While the broker is down, probe with the oldest record alone.
        assert self.spool is not None
        first, records = self.spool.peek(1 if self.broker_down else _REPLAY_RECORDS, _REPLAY_BYTES)
        futures: list[Any] = []
        send_error = False
        placement = self._placement
        try:
            placed = placement.placed(producer)
        except Exception as exc:  # noqa: BLE001 - no metadata within max_block_ms
            log.debug("runwatch: replay send failed: %r", exc)
            records, send_error = [], True
        for value in records:
            try:
                futures.append(producer.send(placement.topic, key=placement.key, value=value, **placed))
            except Exception as exc:  # noqa: BLE001 - no metadata within max_block_ms, or a record too large
                log.debug("runwatch: replay send failed: %r", exc)
                if rejected(exc):
                    futures.append(_REJECTED)
                    continue
                send_error = True
                break
        self.replay = _Replay(first, futures, send_error)

    def finish_replay(self) -> None:
        replay, self.replay = self.replay, None
        assert replay is not None and self.spool is not None
        books = self._books
        # The records acknowledged (or refused for good) from the head on leave the spool;
        # the first one that failed, and everything after it, stays for the next attempt.
        outcomes: list[bool] = []  # per record of that prefix: True acknowledged, False rejected
        for f in replay.futures:
            if f is _REJECTED or (f.failed() and rejected(f.exception)):
                outcomes.append(False)
            elif f.succeeded():
                outcomes.append(True)
            else:
                break
        prefix = len(outcomes)
        later = sum(1 for f in replay.futures[prefix:] if f is not _REJECTED and f.succeeded())
        head = self.spool.head_index  # records of the batch below it were evicted meanwhile (and counted)
        try:
            self.spool.commit(replay.first + prefix)
        except OSError as exc:
            log.warning("runwatch: spool commit failed: %s", exc)
            outcomes = []
        kept = outcomes[max(0, head - replay.first) :]
        acknowledged, refused = kept.count(True), kept.count(False)
        if refused:
            log.warning("runwatch: the broker refused %d spooled events for good; dropped", refused)
            books.count_drop("rejected", refused)
        with books.lock:
            if not books.final:
                books.stats.published += acknowledged
                books.stats.replayed += acknowledged
                books.stats.duplicates_sent += later
                for f in replay.futures:
                    if f is not _REJECTED and f.succeeded():
                        books.acknowledged(f.value)
                books.stats.spool_bytes = self.spool.bytes
        if prefix == len(replay.futures) and not replay.send_error:
            if self.broker_down:
                log.warning(
                    "runwatch: broker %s is back; replaying %d spooled events",
                    self._bootstrap,
                    len(self.spool),
                )
            self.broker_down = False
            self._backoff = _PROBE_BACKOFF_S[0]
            self.next_probe = 0.0
        else:
            self.broker_down = True
            self.next_probe = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, _PROBE_BACKOFF_S[1])

    def close(self) -> None:
        """Close the spool at the delivery's close, removing it if empty; what it still holds is booked as
        ``spooled_at_close``, replayed by the next delivery with the same spool."""
        spool = self.spool
        if spool is None:
            return
        try:
            spool.close()
            spool.remove_if_empty()
        except OSError as exc:
            log.warning("runwatch: closing the spool at %s failed: %s", self.spool_path, exc)
        with self._books.lock:
            self._books.stats.spooled_at_close = len(spool)
            self._books.stats.spool_bytes = spool.bytes
        if len(spool):
            log.warning(
                "runwatch: %d events stay in %s; a RunWatch with the same run id and rank replays them",
                len(spool),
                self.spool_path,
            )
