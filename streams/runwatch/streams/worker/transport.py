"""Faust's aiokafka transport with a short consumer fetch wait, and the hooks that keep offsets with the
log they came from.

faust-streaming 0.15 builds the worker's consumer with ``fetch_max_wait_ms=1500`` and no
setting to change it. A broker that holds a fetch until that wait runs out (Tansu does, when
fewer than ``fetch_min_bytes`` are ready) then delays every event by up to 1.5 s, which is the
floor on detection latency. This transport is the same in every other respect; the worker uses
it through the ``runwatch://`` broker URL scheme.

Its consumer also lets the worker (app.py, log_identity.py) refuse a commit of a position that belongs to
a log the broker no longer has (``commit_guard``), and forget a recreated partition's old positions
(``forget_positions``): Faust keeps them in private fields, and would otherwise drop every record of the
new log below the offset it last read.

And it hands each fetched batch of telemetry records to the worker's per-run budget (``run_budget``,
run_budget.py) before Faust makes events of them: the records shed are never delivered, and their offsets
are marked as a gap, which Faust commits as if they were acknowledged.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from faust.transport.drivers import TRANSPORTS
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.utils.functional import consecutive_numbers

from runwatch.contract import topics
from runwatch.streams.worker.run_budget import RunBudget

FETCH_MAX_WAIT_MS = int(os.environ.get("RUNWATCH_FETCH_MAX_WAIT_MS", "50"))
SCHEME = "runwatch"


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
        return records, active

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
        self._read_offset[tp] = None
        self._committed_offset[tp] = None
        return len(stale)


class Transport(faust_aiokafka.Transport):
    Consumer = Consumer


TRANSPORTS.aliases.setdefault(SCHEME, f"{__name__}:Transport")
