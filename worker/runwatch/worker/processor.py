"""The worker's per-message logic, free of Faust so tests can drive it directly.

Bytes in; dead letters, anomalies and signed actions out. Per-run state is a
``RunMonitor`` per run id; the run's partition owns it (key = run_id). With a state reader,
each run's state is also snapshotted to ``runwatch.state`` (``run_states.py`` says when,
``runwatch.worker.state.snapshot`` how) and restored when this worker is given the run's partition.

Here: what a record and a tick do, and ``RunState``, the class a run's snapshot pickles (its module is
the name existing snapshots use: it stays here). The rest, in layers under processing/: the runs held and
let go (held_runs.py), their outputs (outputs.py), their durable state (durable_state.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import cast

from runwatch.contract.group_report import ReportBody
from runwatch.contract.schema import (
    GroupReport,
    RunStartEvent,
    SchemaError,
    StepEvent,
    TelemetryEvent,
    check_record_key,
    decode_received,
)
from runwatch.detectors import RunMonitor
from runwatch.detectors.engine.group_monitor import GroupMonitor
from runwatch.detectors.engine.merge_monitor import RunMergeMonitor
from runwatch.worker.processing.durable_state import DurableState
from runwatch.worker.processing.results import KeptLedger, ProcessResult, StateRecord, WorkerCounters
from runwatch.worker.split_runs import (
    SplitRunError,
    check_shape,
    new_monitor,
    open_report,
    state_key,
)

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """What a run's snapshot holds: its monitor, and (its newest event time, when that arrived)."""

    monitor: RunMonitor
    last_seen: tuple[datetime, datetime] | None


# What other modules import from here (the results' types live in processing/results.py)
__all__ = ["KeptLedger", "ProcessResult", "RunState", "StateRecord", "TelemetryProcessor", "WorkerCounters"]

# A tick judges runs until this much wall time has passed, then leaves the rest to the next tick
# (round robin), so that one slow run cannot freeze the other runs' timers.
TICK_BUDGET_S = 0.1
_CLOCK_SLACK = timedelta(seconds=1)  # how far a run's clock may run past its record's send time


class TelemetryProcessor(DurableState):
    """One worker's detection: ``process`` a telemetry record, ``tick`` the timers, ``take_snapshots`` and
    restore them (``load_partitions``), follow rebalances (``keep_partitions``, ``log_recreated``). Built
    in layers (runwatch/worker/processing/): the runs held and let go (``HeldRuns``, whose constructor this
    is), their outputs (``RunOutputs``), their durable state (``DurableState``)."""

    _state_type = RunState

    def process(
        self,
        raw: bytes | None,
        key: bytes | None = None,
        partition: int | None = None,
        offset: int | None = None,
        timestamp: float | None = None,
    ) -> ProcessResult:
        """One telemetry message. ``timestamp`` is the Kafka record's (seconds since the epoch): the
        receive time that an event's ``ts`` must lie near (``limits.max_future_s`` / ``max_past_s``). A
        record time that is missing or unusable is not trusted: the event's ``ts`` is then checked against
        the worker's clock. One more than ``max_future_s`` (and at most a day) ahead of the worker's clock is
        a fast clock: the event is judged against it and its time moved back (``decode_received``)."""
        # A record time minutes ahead, with an event time that agrees: the trainer's clock is fast. Judged
        # against its own clock, then moved back onto the worker's, and said (RunMonitor.clock_seen).
        body = None
        try:
            event, received, ahead_s = decode_received(raw, timestamp, self._clock(), self.config.limits, key)
            run_id = state_key(event)  # (a split run's group: its own monitor, split_runs.py)
            # (a run's partition, once checked, is not hashed again for each of its events)
            known = run_id in self._partition and self._partition[run_id] == partition
            check_record_key(key, partition, None if known else self.partitions)
            if isinstance(event, GroupReport):
                body = open_report(event, self._report_keys)
            check_shape(self.monitors.get(run_id), event, body)
        except SchemaError as exc:
            self.counters.deadlettered += 1
            return ProcessResult(deadletter=self._deadletter(exc.reason, raw, key, partition, offset))
        except SplitRunError as exc:
            self.counters.deadlettered += 1
            return ProcessResult(deadletter=self._deadletter(str(exc), raw, key, partition, offset))
        if self._already_judged(run_id, partition, offset):
            self.counters.replay_skipped += 1
            return ProcessResult()
        if self.states is not None:
            if partition is not None:
                self.load_partitions({partition})
            if self.states.already_seen(run_id, partition, offset):
                self.counters.replay_skipped += 1
                return ProcessResult()
        self.counters.processed += 1
        try:
            result = self._observe(event, received, partition, offset, ahead_s, run_id, body)
            result.received_at = received
            return result
        except Exception as exc:  # noqa: BLE001 - one run's failure must not stop the others
            return self._reset_run(run_id, exc, raw, key, partition, offset)

    def _observe(
        self,
        event: TelemetryEvent,
        received: datetime | None,
        partition: int | None,
        offset: int | None = None,
        clock_ahead_s: float | None = None,
        run_id: str | None = None,
        body: ReportBody | None = None,
    ) -> ProcessResult:
        """``run_id``: the key of the monitor the event goes to (a split run's group's: split_runs.py);
        ``body``: a group report's, verified."""
        run_id = run_id or event.run_id
        monitor = self.monitors.get(run_id)
        if monitor is not None and isinstance(monitor, RunMergeMonitor) != (body is not None):
            # the run is split now, or whole again (its job was restarted with another world or group
            # size): the monitor of the other kind goes (check_shape let only a report or a run_start by)
            self._forget(run_id, "restarted")
            monitor = None
        flushed = None
        if (
            monitor is not None
            and isinstance(event, RunStartEvent)
            and (monitor.ended_at is not None or monitor.is_new_attempt(event))
        ):
            # The run starts again under its id (a resumed, requeued or restarted job): a new monitor
            # (and policy), whether or not the old attempt said goodbye.
            flushed = self._result(monitor.finish())  # (its actions name the attempt they were for)
            self._forget(run_id, "restarted")
            log.info(
                "run %s: a new attempt %s: watched as a fresh run", run_id, event.attempt or "(after run_end)"
            )
            monitor = None
        if monitor is None:
            self._make_room(1)
            monitor = self.monitors[run_id] = new_monitor(event, self.config, body)
            self._tick_order.append(run_id)
            history = self._crash_histories.pop(run_id, None)  # (issue 39: its earlier attempts' crashes)
            if history is not None:
                monitor.take_crash_history(history, new_attempt=isinstance(event, RunStartEvent))
            if self._ledgers:
                self._resume_ledger(monitor, event)
        if (
            self.baselines is not None
            and isinstance(event, RunStartEvent)
            and not isinstance(monitor, GroupMonitor)
        ):
            self.baselines.hand(monitor, event)  # (a split run's groups: no history, its own monitor's check)
        if body is not None:
            out = cast(RunMergeMonitor, monitor).observe_report(
                cast(GroupReport, event).group, body, event.ts
            )
        else:
            out = monitor.observe(event)
            if isinstance(event, StepEvent):
                self.step_times.seen(run_id, event.rank, event.ts)
        if clock_ahead_s is not None or monitor.clock_ahead:
            rank = getattr(event, "rank", None) or 0
            said = monitor.clock_seen(rank, clock_ahead_s, event.ts, getattr(event, "step", None))
            out.anomalies += said.anomalies
            out.decisions += said.decisions
            out.report += said.report
        # The run's clock: its newest event time, never ahead of when the record was sent (one event
        # with a skewed clock must not make the run's other ranks look silent).
        ts = event.ts if received is None else min(event.ts, received + _CLOCK_SLACK)
        previous = self._last_seen.get(run_id)
        if previous is None or ts >= previous[0]:
            self._last_seen[run_id] = (ts, self._clock())
        sent = received or self._clock()
        self._activity.seen(
            run_id, self._clock(), monitor.last_step is not None, bool(monitor.checkpoints.good), sent
        )
        newest = self._frontier.get(partition)
        if newest is None or sent > newest:
            self._frontier[partition] = sent
        if partition is not None:
            self._partition[run_id] = partition
            if offset is not None:
                self._judged_to[run_id] = (partition, offset)
        result = self._result(out, monitor)
        if self._let_go:  # (runs evicted to make room for this one)
            result.anomalies[:0] = self._let_go
            self._let_go = []
        if flushed is not None:
            result.joined[:0], result.anomalies[:0], result.actions[:0] = (
                flushed.joined,
                flushed.anomalies,
                flushed.actions,
            )
        if self.states is not None:
            self.states.observed(run_id, partition, offset, emitted=bool(result.anomalies or result.actions))
        if monitor.ended_at is not None and monitor.join.world_size <= 1:
            self._forget(run_id, "ended")  # nobody else's steps to wait for
        return result

    def tick(
        self, now: datetime | None = None, behind: set[int] | frozenset[int] = frozenset()
    ) -> ProcessResult:
        """Time-based checks (stalled or silent ranks) for the runs this worker holds.

        Each run is ticked on its own event time, carried forward by the wall clock since its
        last event arrived: for a live run that is the wall clock, and a backlog read after a
        restart is judged on the time its events were sent, as ``runwatch replay`` does. Runs of
        the telemetry partitions in ``behind`` (the broker holds events of them this worker has not
        read yet) are not carried forward: a worker that falls behind its input must not take its
        own delay for the ranks' silence.
        Runs are judged in round-robin order until ``TICK_BUDGET_S`` has passed; the rest wait
        for the next tick (0.25 s later), so one slow run cannot hold up every other's timer.
        """
        now = now or self._clock()
        result = ProcessResult(anomalies=self._silent_runs(now, behind))
        if self._ledgers:
            self._expire_ledgers(self._clock())
        if self._let_go:
            result.anomalies[:0] = self._let_go
            self._let_go = []
        started = self._perf()
        order = self._tick_order
        judged: set[str] = set()
        for _ in range(len(order)):
            if self._perf() - started > TICK_BUDGET_S:
                self.counters.tick_deferred += 1
                break
            run_id = order.popleft()
            monitor = self.monitors.get(run_id)
            if monitor is None or run_id in judged:
                continue  # ended, moved away, or listed twice (ended and started again): dropped here
            judged.add(run_id)
            order.append(run_id)
            seen = self._last_seen.get(run_id)
            if seen is None:
                continue  # no event time yet (restored without one): nothing to carry forward
            # everything about one run, its clock included, inside the guard: one run's error resets that run
            try:
                event_ts, arrived = seen
                run_now = event_ts if self._partition.get(run_id) in behind else event_ts + (now - arrived)
                if monitor.ended_at is not None and run_now - monitor.ended_at > self._linger:
                    # run_end came a join timeout ago: whatever ranks still owe is not coming
                    part = self._result(monitor.finish(), monitor)
                    self._forget(run_id, "ended")
                else:
                    part = self._result(monitor.tick(run_now), monitor)
                    if self.states is not None and (part.anomalies or part.actions):
                        self.states.emitted(run_id)
            except Exception as exc:  # noqa: BLE001
                result.errors.extend(
                    self._reset_run(run_id, exc, None, None, self._partition.get(run_id), None).errors
                )
                continue
            result.anomalies.extend(part.anomalies)
            result.actions.extend(part.actions)
            result.joined.extend(part.joined)
            result.reports.extend(part.reports)
        self.counters.runs = len(self.monitors)
        return result
