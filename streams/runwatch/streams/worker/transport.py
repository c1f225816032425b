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
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from faust.transport.drivers import TRANSPORTS
from faust.transport.drivers import aiokafka as faust_aiokafka

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

    def _new_consumer_thread(self) -> LowLatencyConsumerThread:
        return LowLatencyConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _commit_offsets(self, offsets: Mapping[Any, int], start_new_transaction: bool = True) -> bool:
        if self.commit_guard is not None:
            offsets = await self.commit_guard(offsets)
            if not offsets:
                return False
        committed: bool = await super()._commit_offsets(offsets, start_new_transaction)
        return committed

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
        self._gap.pop(tp, None)
        self._read_offset[tp] = None
        self._committed_offset[tp] = None
        return len(stale)


class Transport(faust_aiokafka.Transport):
    Consumer = Consumer


TRANSPORTS.aliases.setdefault(SCHEME, f"{__name__}:Transport")
