"""The worker's watch on the telemetry log it reads: offsets belong to the log they came from. A
recreated log (a new topic id, or a log that ends below what was read from it) is read again from its
beginning, and no old log's position is ever committed on the new one (the rules: log_identity.py).

The first of the worker's layers (``DetectWorker`` in app.py, which sets what is declared here)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

from runwatch.contract import topics
from runwatch.worker import transport
from runwatch.worker.detector_process import DetectorProcess
from runwatch.worker.health import WorkerHealth
from runwatch.worker.log_identity import (
    ID_EVERY_S,
    UNKNOWN,
    LogWatch,
    TopicIds,
    commit_offsets_allowed,
)
from runwatch.worker.run_budget import RunBudget
from runwatch.worker.runwatch_app import RunwatchApp

if TYPE_CHECKING:
    from faust.types import TP

    from runwatch.worker.pipeline import Inflight

log = logging.getLogger(__name__)


class LogGuard:
    """Recreated telemetry logs found and read again; commits of an old log's positions refused."""

    # Set by DetectWorker.__init__ (app.py): the app, the detector process, the worker's health, the per-run
    # budget; the pipeline's queue (None: the agent is not running) and the newest offset handed on per
    # telemetry partition (pipeline.py)
    app: RunwatchApp
    detectors: DetectorProcess
    health: WorkerHealth
    budget: RunBudget
    inflight: asyncio.Queue[Inflight] | None
    submitted: dict[int, int]
    # this layer's: the topic id's reader and the log's watch (log_identity.py), when the id was last read
    # and a refused commit last logged
    topic_ids: TopicIds
    watch: LogWatch
    id_reader: ThreadPoolExecutor
    id_read_at: float
    refusal_logged_at: float

    def telemetry_consumer(self) -> transport.Consumer:
        return cast(transport.Consumer, self.app.consumer)

    def high_watermark(self, tp: TP) -> int | None:
        try:
            return cast(int | None, self.app.consumer.highwater(tp))
        except Exception:  # noqa: BLE001 - not fetched yet, or no longer assigned
            return None

    async def read_log_id(self, timeout_s: float) -> object:
        """The telemetry topic's id now (None: the broker reports none; UNKNOWN: it did not answer)."""
        try:
            current = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self.id_reader, self.topic_ids.read), timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - judged by the high watermark alone this time
            log.debug("the %s topic id could not be read: %r", topics.TELEMETRY, exc)
            return UNKNOWN
        self.id_read_at = time.monotonic()
        self.health.log_id = current
        return current

    async def guard_commit(self, offsets: Mapping[TP, int]) -> Mapping[TP, int]:
        """Never commit an old log's position on a new one: telemetry offsets are committed only while
        the topic id is the one they were read under and within their log's end."""
        telemetry = {tp: o for tp, o in offsets.items() if tp.topic == topics.TELEMETRY}
        if not telemetry:
            return offsets
        changed = self.watch.id_changed(await self.read_log_id(2.0))
        allowed, refused = commit_offsets_allowed(telemetry, self.high_watermark, changed)
        if refused:
            self.health.commits_refused += len(refused)
            if time.monotonic() - self.refusal_logged_at >= 10.0:
                self.refusal_logged_at = time.monotonic()
                log.warning(
                    "not committed (an old log's position on a new log): %s",
                    "; ".join(
                        f"{tp.topic}[{tp.partition}]@{offsets[tp]}: {why}" for tp, why in refused.items()
                    ),
                )
        return {**{tp: o for tp, o in offsets.items() if tp.topic != topics.TELEMETRY}, **allowed}

    async def start_over(
        self, partitions: set[int], current: object, why: str, assigned: Iterable[TP] | None = None
    ) -> None:
        """Forget the old log's positions of ``partitions`` here and in the detector process (its runs'
        offsets), and read them again from the beginning of their new log. ``assigned``: at an assignment
        (Faust seeks them to their committed offsets next, which are never an old log's: guard_commit)."""
        consumer = self.telemetry_consumer()
        tps = sorted(
            tp
            for tp in (consumer.assignment() if assigned is None else assigned)
            if tp.topic == topics.TELEMETRY and tp.partition in partitions
        )
        if not tps:
            return
        beginnings: Mapping[TP, int] = {}
        if assigned is None:
            try:
                beginnings = await consumer.earliest_offsets(*tps)
            except Exception:  # noqa: BLE001 - a new log begins at 0
                beginnings = {}
        self.budget.forget({tp.partition for tp in tps})
        for tp in tps:
            unsettled = consumer.forget_positions(tp)
            self.submitted.pop(tp.partition, None)
            start = beginnings.get(tp) or 0
            if assigned is None:
                await consumer.seek(tp, start)
            log.warning(
                "%s[%d] was recreated (%s): read again from %s; the old log's positions are forgotten and "
                "never committed on the new one (%d event(s) of it read and not committed); its runs' "
                "offsets are forgotten",
                tp.topic,
                tp.partition,
                why,
                f"offset {start}" if assigned is None else "its committed offset (or its beginning)",
                unsettled,
            )
        self.watch.recreated({tp.partition for tp in tps}, current)
        log_id = current if isinstance(current, str) else None
        reply = await self.detectors.submit("log_recreated", ({tp.partition for tp in tps}, log_id))
        for run in reply.dropped_runs:
            log.info(
                "run %s: its snapshot was of the old log: it starts fresh with its checkpoint ledger", run
            )

    async def check_log(self) -> None:
        """A recreated telemetry log: a new topic id, or a log that ends below what was read from it."""
        consumer = self.telemetry_consumer()
        if self.inflight is None or self.app.rebalancing or not consumer.flow_active:
            return  # (a rebalance sets the positions: judged once it is over)
        current = UNKNOWN
        if time.monotonic() - self.id_read_at >= ID_EVERY_S:
            current = await self.read_log_id(ID_EVERY_S)
        owned = {tp: tp.partition for tp in consumer.assignment() if tp.topic == topics.TELEMETRY}
        if self.watch.id_changed(current):
            was = self.watch.known_id
            await self.start_over(set(owned.values()), current, f"a new topic id {current}, was {was}")
            return
        for tp, partition in owned.items():
            read = consumer.read_offset(tp)
            position = max(read if read is not None else -1, self.submitted.get(partition, -1) + 1)
            high = self.high_watermark(tp)
            if self.watch.ends_below(partition, high, position if position >= 0 else None):
                await self.start_over(
                    {partition}, current, f"its log ends at {high}, below offset {position}"
                )
