"""Per-run budgets on a telemetry partition: one run's flood must not starve the other runs that share
its partition (issue 35).

A partition is read in order, so a victim's events that follow a flood are reached only once the flood
is read. Reading a record raw costs a few microseconds; judging it costs the detectors' hundreds. So the
worker's consumer (transport.py) asks this module, record by record and before Faust builds an event of
it, whether the record goes on: a run may send ``events_per_s`` with bursts of ``burst_events``, and a
partition admits ``new_runs_per_s`` run ids it has not seen (bursts of ``new_runs_burst``), so that a
flood of made-up run ids is held back too. What is over budget is shed: never judged, counted and
reported (``take_shed``: a dead letter per run, a log line, the health counters), and its offsets are
committed like the others'.

Time here is the time a record reached the broker, as this worker saw the log grow: after each fetch it
notes the partition's end (its high watermark) against its own clock, and a record's time lies between
the two notes around its offset, spread evenly. A client's record timestamp cannot buy a flood tokens
(it is the client's to set; Tansu does not stamp ``LogAppendTime``). Records that were in the log before
this worker first read the partition (a backlog after a restart or a rebalance) have no such time and are
not budgeted: a backlog is read as fast as the worker can, and nothing of it is shed.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

NEW_RUN = "new_run"  # a run id the partition has not seen, beyond new_runs_per_s
OVER_BUDGET = "over_budget"  # a run's events beyond events_per_s
MAX_RUNS_PER_PARTITION = 50_000  # run ids whose buckets a partition keeps (least recent go first)
MAX_SHED_REPORTS = 100  # runs reported one by one per report; the rest are summed


class Record(Protocol):
    """What the budget reads of a consumer record (aiokafka's ConsumerRecord has both)."""

    @property
    def offset(self) -> int: ...

    @property
    def key(self) -> bytes | None: ...


@dataclass(frozen=True)
class BudgetLimits:
    events_per_s: float  # 0: no budget at all
    burst_events: int
    new_runs_per_s: float
    new_runs_burst: int

    @property
    def enabled(self) -> bool:
        return self.events_per_s > 0


@dataclass
class ShedRun:
    """Events of one run shed on one partition since the last report."""

    reason: str
    count: int = 0
    first_offset: int = -1
    last_offset: int = -1


@dataclass
class ShedReport:
    """What ``take_shed`` hands over: per (partition, run key) at most MAX_SHED_REPORTS, the rest summed."""

    runs: dict[tuple[int, bytes], ShedRun] = field(default_factory=dict)
    other_events: int = 0  # shed events of runs past MAX_SHED_REPORTS

    @property
    def events(self) -> int:
        return sum(s.count for s in self.runs.values()) + self.other_events


class _Bucket:
    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float):
        self.tokens, self.at = tokens, at

    def take(self, now: float, rate: float, burst: int) -> bool:
        if now > self.at:
            self.tokens = min(float(burst), self.tokens + (now - self.at) * rate)
            self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class _Partition:
    """A partition's log growth as this worker saw it, and its runs' buckets."""

    def __init__(self, end: int, now: float, limits: BudgetLimits):
        self.watch_from = end  # records below: in the log before this worker read it (not budgeted)
        self.below: tuple[int, float] = (end, now)  # the last note at or below the record being judged
        self.notes: deque[tuple[int, float]] = deque()  # later notes of (end, time), ends increasing
        self.runs: OrderedDict[bytes, _Bucket] = OrderedDict()
        self.newcomers = _Bucket(float(limits.new_runs_burst), now)
        self.last_read = -1  # the newest offset judged (admitted or shed)
        self.last_admitted = -1

    def note_end(self, end: int, now: float) -> None:
        last = self.notes[-1][0] if self.notes else self.below[0]
        if end > last:
            self.notes.append((end, now))

    def arrival(self, offset: int, now: float) -> float | None:
        """When ``offset`` reached the broker, as well as this worker knows; None: before it watched."""
        if offset < self.watch_from:
            return None
        while self.notes and self.notes[0][0] <= offset:
            self.below = self.notes.popleft()
        if not self.notes:
            return now
        (lo_end, lo_t), (hi_end, hi_t) = self.below, self.notes[0]
        return lo_t + (offset - lo_end + 1) / (hi_end - lo_end) * (hi_t - lo_t)


class RunBudget:
    """The budgets of every telemetry partition this worker reads (one consumer task calls it)."""

    def __init__(self, limits: BudgetLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._partitions: dict[int, _Partition] = {}
        self._shed = ShedReport()
        self.shed_total = 0
        self.shed_new_runs = 0

    def note_end(self, partition: int, end: int | None) -> None:
        """After a fetch: the partition's log ends at ``end`` (its high watermark) now."""
        if end is None or not self.limits.enabled:
            return
        now = self._clock()
        p = self._partitions.get(partition)
        if p is None:
            self._partitions[partition] = _Partition(end, now, self.limits)
        else:
            p.note_end(end, now)

    def forget(self, partitions: set[int] | None = None) -> None:
        """Start watching these partitions (None: all) afresh: after an assignment or a seek."""
        for partition in list(self._partitions) if partitions is None else partitions:
            self._partitions.pop(partition, None)

    def split(self, partition: int, records: Sequence[Record]) -> tuple[list[Record], list[tuple[int, int]]]:
        """The records that go on, in order, and the offset ranges (first, last) of those shed."""
        p = self._partitions.get(partition)
        if p is None or not records:
            return list(records), []
        limits, now = self.limits, self._clock()
        rate, burst = limits.events_per_s, limits.burst_events
        kept: list[Record] = []
        shed: list[tuple[int, int]] = []
        runs = p.runs
        previous_shed = False
        for record in records:
            offset, key = record.offset, record.key or b""
            at = p.arrival(offset, now)
            bucket = runs.get(key)
            admitted = True
            reason = OVER_BUDGET
            if bucket is None:
                if at is not None and not p.newcomers.take(at, limits.new_runs_per_s, limits.new_runs_burst):
                    admitted, reason = False, NEW_RUN
                else:
                    bucket = runs[key] = _Bucket(float(burst), at if at is not None else now)
                    if len(runs) > MAX_RUNS_PER_PARTITION:
                        runs.popitem(last=False)
            else:
                runs.move_to_end(key)
            if admitted and at is not None and bucket is not None:
                admitted = bucket.take(at, rate, burst)
            p.last_read = offset
            if admitted:
                kept.append(record)
                p.last_admitted = offset
                previous_shed = False
                continue
            self._count_shed(partition, key, offset, reason)
            if previous_shed:  # (one range for a run of shed records, whatever offsets lie between)
                shed[-1] = (shed[-1][0], offset)
            else:
                shed.append((offset, offset))
            previous_shed = True
        return kept, shed

    def caught_up(self, partition: int, submitted: int) -> bool:
        """Whether everything read of ``partition`` was handed on (through ``submitted``) or shed."""
        p = self._partitions.get(partition)
        return p is not None and p.last_admitted <= submitted <= p.last_read

    def read_through(self, partition: int) -> int:
        p = self._partitions.get(partition)
        return -1 if p is None else p.last_read

    def _count_shed(self, partition: int, key: bytes, offset: int, reason: str) -> None:
        self.shed_total += 1
        if reason == NEW_RUN:
            self.shed_new_runs += 1
        report = self._shed
        entry = report.runs.get((partition, key))
        if entry is None:
            if len(report.runs) >= MAX_SHED_REPORTS:
                report.other_events += 1
                return
            entry = report.runs[(partition, key)] = ShedRun(reason, first_offset=offset)
        entry.count += 1
        entry.last_offset = offset

    def take_shed(self) -> ShedReport:
        """What was shed since the last call (and start counting again)."""
        report, self._shed = self._shed, ShedReport()
        return report
