"""Faust's aiokafka transport with a short consumer fetch wait, and the hooks that keep offsets with the
log they came from.

faust-streaming 0.15 builds the worker's consumer with ``fetch_max_wait_ms=1500`` and no
setting to change it. A broker that does not answer a fetch as soon as records arrive (Tansu looks
again after half the wait left: see ``FETCH_MAX_WAIT_MS``) then delays every event by up to 0.75 s,
which is the floor on detection latency. This transport is the same in every other respect; the worker uses
it through the ``runwatch://`` broker URL scheme.

Its consumer also lets the worker (log_guard.py, log_identity.py) refuse a commit of a position that
belongs to a log the broker no longer has (``commit_guard``), and forget a recreated partition's old
positions (``forget_positions``): Faust keeps them in private fields, and would otherwise drop every record
of the new log below the offset it last read.

And it hands each fetched batch of telemetry records to the worker's per-run budget (``run_budget``,
run_budget.py) before Faust makes events of them: the records shed are never delivered, and their offsets
are marked as a gap, which Faust commits as if they were acknowledged.

The worker takes the telemetry records itself, as fetched (``take_telemetry`` on the app: the worker's
``take``, pipeline.py): Faust's per-event machinery (a message, an event, a channel, a stream and sensors per
record) cost more than the detectors once did. The records taken keep Faust's bookkeeping: its read offsets
and gaps as its own fetch loop keeps them, and their offsets join its acknowledged ones (``settle``) only once
the worker has delivered their results, so Faust commits them as it commits acknowledged events; a revoke or a
stop waits for what was taken to be settled (``wait_empty``, with the app's ``telemetry_settled``).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from faust.transport.drivers import TRANSPORTS
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.utils.functional import consecutive_numbers

from runwatch.contract import topics
from runwatch.worker.run_budget import RunBudget

log = logging.getLogger(__name__)

# How long the broker may hold a fetch that finds nothing new. Tansu does not answer when records arrive: it
# looks again after half the wait left, then half the rest, ... (tansu-storage's FetchService, v0.6.0), so
# a record that arrives during a wait of W ms is handed over up to W/2 later (W/6 on average; measured with
# kafka-python: docs/profiles/worker.md). The wait is short while telemetry has been arriving lately
# (ACTIVE_FOR_S), longer when the worker is idle (fewer empty fetches).
FETCH_MAX_WAIT_MS = int(os.environ.get("RUNWATCH_FETCH_MAX_WAIT_MS", "50"))
# (at least 1 ms: Tansu answers a fetch with no wait before it looks at all, with no records, ever)
ACTIVE_FETCH_MAX_WAIT_MS = max(1, int(os.environ.get("RUNWATCH_ACTIVE_FETCH_MAX_WAIT_MS", "5")))
ACTIVE_FOR_S = 10.0
SCHEME = "runwatch"


@dataclass(frozen=True)
class Taken:
    """Telemetry records of one partition taken by the worker from one fetch, in offset order. ``epoch``:
    the partition's bookkeeping they belong to (a revoke or a recreated log starts another)."""

    tp: Any
    epoch: int
    records: list[Any]  # aiokafka ConsumerRecords


@dataclass(frozen=True)
class Settlement:
    """Offsets of one partition whose results are delivered: ``Consumer.settle`` acknowledges them."""

    tp: Any
    epoch: int
    offsets: list[int]


class LowLatencyConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # aiokafka reads this when start() builds its fetcher, after construction.
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


class Consumer(faust_aiokafka.Consumer):
    # Set by the worker: given the offsets about to be committed, the ones that may be (None: all)
    commit_guard: Callable[[Mapping[Any, int]], Awaitable[Mapping[Any, int]]] | None = None
    # Set by the worker: which telemetry records go on to the detectors (None: all)
    run_budget: RunBudget | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gaps: dict[Any, list[list[int]]] = {}
        self._epochs: dict[Any, int] = {}
        self._telemetry_at = float("-inf")  # monotonic time telemetry was last fetched

    def _new_consumer_thread(self) -> LowLatencyConsumerThread:
        return LowLatencyConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _commit_offsets(self, offsets: Mapping[Any, int], start_new_transaction: bool = True) -> bool:
        if self.commit_guard is not None:
            offsets = await self.commit_guard(offsets)
            if not offsets:
                return False
        committed: bool = await super()._commit_offsets(offsets, start_new_transaction)
        return committed

    async def _wait_next_records(self, timeout: float) -> tuple[Any, Any]:
        self._set_fetch_wait()
        records, active = await super()._wait_next_records(timeout)
        budget = self.run_budget
        if records and budget is not None and budget.limits.enabled:
            for tp, batch in records.items():
                if tp.topic != topics.TELEMETRY or not batch:
                    continue
                budget.note_end(tp.partition, self.highwater(tp))
                kept, shed = budget.split(tp.partition, batch)
                if shed:
                    records[tp] = kept  # type: ignore[index] # (a dict: aiokafka's getmany builds one)
                    for first, last in shed:
                        self._mark_gap(tp, first, last + 1)
        take: Callable[[list[Taken]], Awaitable[None]] | None = getattr(self.app, "take_telemetry", None)
        if records and take is not None:
            taken = self._take(records, active)
            if taken:
                await take(taken)
        return records, active

    def _take(self, records: Any, active: Any) -> list[Taken]:
        """The telemetry records of ``records`` (removed from it), with Faust's fetch loop's bookkeeping:
        records below the partition's read offset dropped (fetched before a seek), skipped offsets marked as
        gaps, the read offset moved on, and the stream's inbound time noted (its livelock check)."""
        taken: list[Taken] = []
        flowing = self.flow_active
        read = self._read_offset
        inbound = getattr(self.app.monitor, "stream_inbound_time", None)
        now = time.monotonic()
        for tp in [tp for tp in records if tp.topic == topics.TELEMETRY]:
            batch = records.pop(tp)
            if not batch or not flowing:
                continue  # (a revoke stopped the flow: Faust drops these too, and seeks back after it)
            if active is not None and tp not in active and tp not in self._buffered_partitions:
                continue  # paused
            r_offset = read[tp]
            kept = []
            for record in batch:
                offset = record.offset
                if r_offset is None or offset >= r_offset:
                    if r_offset and offset - r_offset > 1:
                        self._mark_gap(tp, r_offset + 1, offset)
                    kept.append(record)
                    r_offset = offset
            if kept:
                read[tp] = r_offset
                self._telemetry_at = now
                if inbound is not None:
                    inbound[tp] = now
                taken.append(Taken(tp, self._epochs.get(tp, 0), kept))
        return taken

    def _set_fetch_wait(self) -> None:
        thread_consumer = getattr(self._thread, "_consumer", None)
        fetcher = getattr(thread_consumer, "_fetcher", None)
        if fetcher is not None:
            recent = time.monotonic() - self._telemetry_at < ACTIVE_FOR_S
            fetcher._fetch_max_wait_ms = ACTIVE_FETCH_MAX_WAIT_MS if recent else FETCH_MAX_WAIT_MS

    def epoch(self, tp: Any) -> int:
        """The bookkeeping ``tp``'s records taken now belong to (``Taken.epoch``)."""
        return self._epochs.get(tp, 0)

    def settle(self, settlements: Iterable[Settlement]) -> None:
        """The offsets whose results are delivered, acknowledged as Faust's ``ack`` would (those of a
        bookkeeping gone since, a revoked partition's or a recreated log's, are not)."""
        epochs = self._epochs
        for settled in settlements:
            tp = settled.tp
            if epochs.get(tp, 0) != settled.epoch:
                continue
            committed = self._committed_offset[tp]
            offsets = settled.offsets
            if committed is not None:
                offsets = [o for o in offsets if o >= committed]
            index = self._acked_index[tp]
            offsets = [o for o in offsets if o not in index]
            index.update(offsets)
            self._acked[tp].extend(offsets)
            self._n_acked += len(offsets)

    async def wait_empty(self) -> None:
        # (a revoke, or a stop: what the worker took is settled first, as Faust waits for its streams' events)
        settled: Callable[[], bool] | None = getattr(self.app, "telemetry_settled", None)
        started = logged = time.monotonic()
        while settled is not None and not self.should_stop and not settled():
            if time.monotonic() - logged >= 10.0:
                logged = time.monotonic()
                log.warning(
                    "waiting %.0f s for the telemetry taken to be settled (its results delivered)",
                    logged - started,
                )
            await asyncio.sleep(0.01)
        await super().wait_empty()

    # Offsets that no message will acknowledge (shed here, or missing from the log), kept per partition as
    # ranges in offset order. Faust keeps them in an IntervalTree that it rebuilds at every gap added: a
    # flood shed in thousands of pieces took the consumer most of a minute per fetch.
    async def _add_gap(self, tp: Any, offset_from: int, offset_to: int) -> None:
        # (Faust's fetch loop: the offsets between the last message read and this one, which it passes
        # as ``offset_to`` and counted as acknowledged too; it is not, until it is)
        self._mark_gap(tp, offset_from, offset_to)

    def _mark_gap(self, tp: Any, begin: int, end: int) -> None:
        """Offsets ``begin`` up to ``end`` (excluded) will never be acknowledged: commit past them."""
        committed = self._committed_offset.get(tp)
        if committed is not None:
            begin = max(begin, committed)
        if begin >= end:
            return
        gaps: list[list[int]] = self._gaps.setdefault(tp, [])
        if gaps and gaps[-1][0] <= begin <= gaps[-1][1]:
            gaps[-1][1] = max(gaps[-1][1], end)
        else:
            bisect.insort(gaps, [begin, end])

    def _new_offset(self, tp: Any) -> int | None:
        # Faust's, with the gaps above: the offset after the first run of consecutive offsets that are
        # acknowledged or in a gap, from the lowest; None when that run does not follow the committed one.
        acked: list[int] = self._acked[tp]
        if not acked:
            return None
        gaps = self._gaps.get(tp)
        if gaps:
            newest = max(acked)
            taken = 0
            while taken < len(gaps) and gaps[taken][0] < newest:
                acked.extend(range(*gaps[taken]))
                taken += 1
            del gaps[:taken]
        acked.sort()
        committed = self._committed_offset[tp]
        if committed and acked[0] - committed > 1:
            return None
        batch = next(consecutive_numbers(acked))
        acked[: len(batch)] = []
        self._acked_index[tp].difference_update(batch)
        return int(batch[-1]) + 1

    async def on_partitions_revoked(self, revoked: Any) -> None:
        for tp in revoked:
            self._gaps.pop(tp, None)
            self._epochs[tp] = self._epochs.get(tp, 0) + 1
        await super().on_partitions_revoked(revoked)

    def read_offset(self, tp: Any) -> int | None:
        """Where Faust has read ``tp`` to: the offset it was sent to (a seek, a committed offset), or the
        offset of the last record it read; None when neither."""
        offset: int | None = self._read_offset.get(tp)
        return offset

    def forget_positions(self, tp: Any) -> int:
        """Forget what Faust knows of ``tp``'s old log (the offsets read, acknowledged and committed) and
        settle the messages read from it and not acknowledged yet without recording them, so that their
        acknowledgement commits nothing. Returns how many such messages there were. (The caller then
        seeks ``tp`` to where the new log starts.)"""
        stale = [m for m in list(self._unacked_messages) if m.tp == tp]
        for message in stale:
            message.acked = True  # (Message.ack is a no-op from now on)
            self._unacked_messages.discard(message)
        self._acked.pop(tp, None)
        self._acked_index.pop(tp, None)
        self._gaps.pop(tp, None)
        self._epochs[tp] = self._epochs.get(tp, 0) + 1  # (the old log's records taken settle nothing)
        self._read_offset[tp] = None
        self._committed_offset[tp] = None
        return len(stale)


class Transport(faust_aiokafka.Transport):
    Consumer = Consumer


TRANSPORTS.aliases.setdefault(SCHEME, f"{__name__}:Transport")
