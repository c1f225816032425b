"""The worker's pipeline to its detector process, in request order: telemetry records as the consumer
fetches them (``take``, transport.py) and the timer's ticks go to the detector process in batches, their
results are published, and events are acknowledged once the broker has every record they produced and a
state checkpoint after them (run_states.py). Whatever stops it fails the worker.

The second of the worker's layers (``DetectWorker`` in app.py, which sets what is declared here)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from runwatch.contract import topics
from runwatch.worker import transport
from runwatch.worker.detector_process import (
    DetectorProcessError,
    Outgoing,
    RawEvent,
)
from runwatch.worker.log_guard import LogGuard

if TYPE_CHECKING:
    import faust
    from faust.types import RecordMetadata, StreamT

    from runwatch.worker.pipeline_queues import Delivered, Inflight

log = logging.getLogger(__name__)

# Events go to the detector process as they were fetched, in requests of up to this many: a backlog fills
# them at once, and a quiet run's event goes alone, with no wait for others (transport.py takes them).
BATCH_MAX_EVENTS = 500
# batches sent to the detector process and not yet answered (a few, so it never idles)
MAX_BATCHES_IN_FLIGHT = 6
MAX_BATCHES_AWAITING_DELIVERY = 64  # batches whose records are sent, waiting for the broker's acknowledgement
DELIVERY_TIMEOUT_S = 60.0  # the producer retries within this; a record still undelivered fails the worker


class Pipeline(LogGuard):
    """Batches to the detector process, their records published, their events acknowledged."""

    # Set by DetectWorker.__init__ (app.py): the topics results go to, by name; how long a record's delivery
    # may take; the requests' order; telemetry events taken from the consumer (transport.py) and not settled
    # yet (acknowledged, or dropped unsent: a revoke waits for none to be left); whether the agent has
    # started the pipeline (``take`` hands events on)
    out_topics: dict[str, faust.TopicT]
    delivery_timeout_s: float
    in_order: asyncio.Lock
    unsettled: int
    pipeline_ready: asyncio.Event

    async def fail(self, reason: str, exc: BaseException) -> None:
        self.health.fail(reason)
        await self.app.crash(exc)
        raise exc

    async def send(self, records: list[Outgoing]) -> list[Awaitable[RecordMetadata]]:
        """Hand the records to the producer in order; returns their delivery futures."""
        try:
            return [
                await self.out_topics[r.topic].send(key=r.key, value=r.value, partition=r.partition)
                for r in records
            ]
        except Exception as exc:  # refused before sending (e.g. too large): never acked
            self.health.publish_failures += 1
            await self.fail(
                f"cannot publish results ({len(records)} records): {exc!r}; their events stay uncommitted",
                exc,
            )
            raise

    def behind(self) -> list[int]:
        """Telemetry partitions whose broker holds events this worker has not handed on yet."""
        lagging = []
        submitted, budget = self.submitted, self.budget
        for tp in self.app.consumer.assignment():
            if tp.topic != topics.TELEMETRY or tp.partition not in submitted:
                continue  # (nothing read from it yet: unknown, judged as caught up)
            try:
                high = self.app.consumer.highwater(tp)
            except Exception:  # noqa: BLE001 - no fetch answered yet
                continue
            if high is not None and high - 1 > submitted[tp.partition]:
                if budget.caught_up(tp.partition, submitted[tp.partition]) and (
                    budget.read_through(tp.partition) >= high - 1
                ):
                    continue  # (what follows the last event handed on was shed: run_budget.py)
                lagging.append(tp.partition)
        return lagging

    async def submit(
        self, kind: str, payload: Any, batch: list[Any] | None, done: asyncio.Future[bool] | None = None
    ) -> None:
        """``done`` resolves once this request's records are delivered and, at a checkpoint, acknowledged."""
        async with self.in_order:  # (the child answers in request order: the queue must hold that order too)
            assert self.inflight is not None  # (only while the agent runs)
            await self.inflight.put((batch, self.detectors.submit(kind, payload), done))

    async def acknowledge(self, delivered: asyncio.Queue[Delivered]) -> None:
        # A batch's events are acknowledged (so their offsets may be committed) only once the broker has
        # acknowledged every record they produced, and a checkpoint after them. The producer retries
        # transient errors itself; what still fails fails the worker, and the events are read again by
        # its successor.
        held: list[transport.Settlement] = []
        consumer = self.telemetry_consumer()
        while True:
            batch, futures, checkpoint, done, finding_times = await delivered.get()
            try:
                if futures:
                    await asyncio.wait_for(asyncio.gather(*futures), self.delivery_timeout_s)
            except Exception as exc:  # noqa: BLE001 - fail() fails the worker and raises it again
                self.health.publish_failures += 1
                events = sum(len(s.offsets) for s in batch or ())
                what = f"results of {events} events" if batch else "timer findings and snapshots"
                await self.fail(
                    f"{what} were not delivered: {exc!r}; the events they cover stay uncommitted", exc
                )
            if finding_times:  # (published: the detection latency of each, once per finding)
                self.health.latency.observe_since(finding_times, time.time())
            if batch:
                held.extend(batch)
            if checkpoint:
                consumer.settle(held)
                self.unsettled -= sum(len(s.offsets) for s in held)
                held.clear()
                self.health.last_ack = time.monotonic()
            if done is not None and not done.done():
                done.set_result(checkpoint)

    async def complete(self, inflight: asyncio.Queue[Inflight], delivered: asyncio.Queue[Delivered]) -> None:
        # In order: send a request's records, then hand them to the acknowledger, while the next runs.
        while True:
            batch, reply, done = await inflight.get()
            # (a request's findings go out first, while the child snapshots their runs)
            futures = await self.send(await self.detectors.findings(reply))
            try:
                answer = await reply
            except DetectorProcessError as exc:
                await self.fail(str(exc).splitlines()[0], exc)
            futures += await self.send(answer.records)
            await delivered.put((batch, futures, answer.checkpoint, done, answer.finding_times))

    async def detect(self, stream: StreamT[Any]) -> None:
        """The agent: subscribes the app to telemetry and runs the pipeline to the detector process, which
        ``take`` feeds with the records as the consumer fetches them (Faust's streams never see them)."""
        inflight: asyncio.Queue[Inflight] = asyncio.Queue(maxsize=MAX_BATCHES_IN_FLIGHT)
        delivered: asyncio.Queue[Delivered] = asyncio.Queue(maxsize=MAX_BATCHES_AWAITING_DELIVERY)
        completer = asyncio.ensure_future(self.complete(inflight, delivered))
        acknowledger = asyncio.ensure_future(self.acknowledge(delivered))
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.detectors.wait_ready)
            self.inflight = inflight
            self.telemetry_consumer().commit_guard = self.guard_commit
            self.telemetry_consumer().run_budget = self.budget
            self.pipeline_ready.set()
            finished, _ = await asyncio.wait((completer, acknowledger), return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()  # the detector process or publishing failed: crash with its error
        finally:
            self.pipeline_ready.clear()
            self.inflight = None
            completer.cancel()
            acknowledger.cancel()

    async def take(self, taken: list[transport.Taken]) -> None:
        """Telemetry records as fetched (transport.py), to the detector process in requests of at most
        ``BATCH_MAX_EVENTS``, in offset order per partition. Called by the consumer's fetch loop, which waits
        for it: a full pipeline holds the next fetch back. Records of a log found recreated meanwhile
        (start_over) are dropped unsent."""
        items = [(t.tp, t.epoch, record) for t in taken for record in t.records]
        self.unsettled += len(items)  # (counted at once: a revoke from now on waits for them)
        sent = 0
        try:
            if not self.pipeline_ready.is_set():
                await self.pipeline_ready.wait()
            consumer = self.telemetry_consumer()
            submitted, health = self.submitted, self.health
            for start in range(0, len(items), BATCH_MAX_EVENTS):
                chunk = items[start : start + BATCH_MAX_EVENTS]
                raw: list[RawEvent] = []
                offsets: dict[tuple[Any, int], list[int]] = {}
                for tp, epoch, record in chunk:
                    if consumer.epoch(tp) != epoch:
                        continue  # (its log was recreated while this waited: read again from its start)
                    timestamp = record.timestamp
                    raw.append(
                        (
                            record.value,
                            record.key,
                            record.partition,
                            record.offset,
                            None if timestamp is None else timestamp / 1000.0,
                        )
                    )
                    offsets.setdefault((tp, epoch), []).append(record.offset)
                    submitted[record.partition] = record.offset  # (the newest: after a seek back, lower)
                dropped = len(chunk) - len(raw)
                if raw:
                    settlements = [transport.Settlement(tp, e, o) for (tp, e), o in offsets.items()]
                    await self.submit("events", raw, settlements)
                    health.events_submitted += len(raw)
                sent += len(chunk)
                self.unsettled -= dropped
        finally:
            self.unsettled -= len(items) - sent  # (not sent: cancelled, or the pipeline stopped)
