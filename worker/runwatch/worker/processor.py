"""The worker's per-message logic, free of Faust so tests can drive it directly.

Bytes in; dead letters, anomalies and signed actions out. Per-run state is a
``RunMonitor`` per run id; the run's partition owns it (key = run_id). With a state reader,
each run's state is also snapshotted to ``runwatch.state`` (``run_states.py`` says when,
``runwatch.worker.state.snapshot`` how) and restored when this worker is given the run's partition.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from runwatch.contract import topics
from runwatch.contract.group_report import ReportBody
from runwatch.contract.groups import parse_key
from runwatch.contract.schema import (
    CLOCK_AHEAD_PARAM,
    Action,
    Anomaly,
    DeadLetter,
    GroupReport,
    JoinedStep,
    RunStartEvent,
    SchemaError,
    StepEvent,
    TelemetryEvent,
    action_expiry,
    check_record_key,
    decode_received,
    utc_now,
)
from runwatch.contract.signing import ActionPublicKeys, ActionSigningKey
from runwatch.detectors import MonitorOutput, RunMonitor, RunwatchConfig
from runwatch.detectors.engine.crashes import CrashHistory
from runwatch.detectors.engine.group_monitor import GroupMonitor
from runwatch.detectors.engine.merge_monitor import RunMergeMonitor
from runwatch.detectors.engine.monitor import RunLedger
from runwatch.detectors.engine.policy import ActionDecision
from runwatch.worker.run_lifecycle import (
    RunActivity,
    eviction_message,
    lifecycle_finding,
    silence_message,
)
from runwatch.worker.split_runs import (
    SplitRunError,
    check_shape,
    new_monitor,
    open_report,
    signed_reports,
    state_key,
)
from runwatch.worker.state.published import Published, read_published
from runwatch.worker.state.restore_progress import RestoreProgress
from runwatch.worker.state.run_states import RunStates, StateOptions
from runwatch.worker.state.snapshot import (
    SnapshotError,
    SnapshotHeader,
    config_digest,
    decode_body,
    decode_header,
    encode_snapshot,
    resolve_state_secret,
)
from runwatch.worker.step_times import StepTimes

if TYPE_CHECKING:
    from runwatch.worker.baselines import BaselineLoader
    from runwatch.worker.state.reader import StateReader

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """What a run's snapshot holds: its monitor, and (its newest event time, when that arrived)."""

    monitor: RunMonitor
    last_seen: tuple[datetime, datetime] | None


@dataclass(frozen=True)
class KeptLedger:
    """The ledger of a run let go (``RunLedger``), its telemetry partition and when it was let go."""

    ledger: RunLedger
    partition: int | None
    let_go_at: datetime


@dataclass(frozen=True)
class StateRecord:
    """One record for ``runwatch.state``: a snapshot or marker (``value``), or a tombstone (None). ``key``:
    the consumer group, a slash, the run id (two deployments in two groups keep their own state)."""

    key: str
    partition: int
    value: bytes | None


@dataclass
class ProcessResult:
    deadletter: DeadLetter | None = None
    anomalies: list[Anomaly] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    joined: list[JoinedStep] = field(default_factory=list)  # multi-rank runs' joined steps
    errors: list[DeadLetter] = field(default_factory=list)  # detector_error records (a run's state was reset)
    reports: list[GroupReport] = field(default_factory=list)  # a split run's groups' (split_runs.py)
    # When the record these findings came of reached the broker (its record time, as the worker judged it):
    # where the metrics' detection latency starts (an event time may be hours old: a backlog, a replay, a
    # simulated clock). None: a tick's.
    received_at: datetime | None = None


@dataclass
class WorkerCounters:
    processed: int = 0
    deadlettered: int = 0
    anomalies: int = 0
    actions: Counter[str] = field(default_factory=Counter)
    detector_errors: int = 0  # events or ticks whose handling raised: the run's state was reset
    runs: int = 0  # runs held now
    tick_deferred: int = 0  # runs whose tick was left to the next one (the tick's time budget ran out)
    snapshots: int = 0  # run snapshots written (markers and tombstones not counted)
    snapshot_bytes: int = 0
    snapshot_failures: int = 0  # not written (state that does not pickle, or over the record limit)
    restored_runs: int = 0  # runs restored from a snapshot when their partition was assigned
    restore_failures: int = 0  # unreadable state records: those runs started fresh
    # events read again that a restored snapshot already included, or that this worker already judged (the
    # consumer seeks back to the committed offset after a rebalance that left it the partition)
    replay_skipped: int = 0
    # anomalies and actions decided again that a predecessor had published (published.py)
    repeats_withheld: int = 0
    # runs let go without run_end, by why (silent, evicted)
    runs_let_go: Counter[str] = field(default_factory=Counter)
    ledgers: int = 0  # checkpoint ledgers of runs let go held now (runs.ledger_retention_s)
    ledgers_resumed: int = 0  # runs back after they were let go that took their ledger on
    # telemetry partitions found recreated (a new topic id, or a log that ends below what was read): read
    # again from their beginning, their runs' old-log offsets forgotten
    logs_recreated: int = 0
    stale_snapshots: int = 0  # snapshots of an old log (a recreated topic): dropped, their ledgers kept
    # findings published, by (detector, severity): the worker's metrics (metrics_server.py)
    findings: Counter[tuple[str, str]] = field(default_factory=Counter)


_Published = TypeVar("_Published", Anomaly, Action)

EVICTION_LOG_EVERY_S = 10.0  # runs evicted past runs.max_runs are logged as one line at most this often

# A tick judges runs until this much wall time has passed, then leaves the rest to the next tick
# (round robin), so that one slow run cannot freeze the other runs' timers.
TICK_BUDGET_S = 0.1
MAX_CRASH_HISTORIES = 4096  # runs let go whose crashes a worker remembers for their next attempt


class TelemetryProcessor:
    def __init__(
        self,
        config: RunwatchConfig,
        secret: bytes,
        clock: Callable[[], datetime] = utc_now,
        perf_clock: Callable[[], float] = time.perf_counter,
        baselines: BaselineLoader | None = None,
        state_reader: StateReader | None = None,
        state: StateOptions | None = None,
        group: str = topics.DETECT_GROUP,
        partitions: int | None = None,
        state_secret: bytes | None = None,
    ):
        """``secret``: the action signing key's 32-byte seed (the workers' private key: trainers hold only
        its public key). ``state_reader``: where runs' snapshots
        are read back from (None: no durable state; every request is then its own checkpoint). ``state``:
        when snapshots are taken. ``state_secret``: the workers' state key snapshots are signed with
        (needed with durable state; never a key trainers hold: state/snapshot.py).
        ``group``: the workers' consumer group, whose snapshots these are. ``partitions``: the telemetry
        topic's partition count; a record on another partition than its key's is refused (None: not
        checked)."""
        self.config = config
        self.partitions = partitions
        # a run's history and band, handed to its monitor at run_start (worker/baselines.py)
        self.baselines = baselines
        self._secret = secret
        self._signing_key = ActionSigningKey.from_seed(secret)  # (ValueError: not a 32-byte seed)
        self._report_keys = ActionPublicKeys([self._signing_key.public])  # a split run's groups' reports
        self._clock = clock  # wall clock for issued_at/expires_at: expiry is checked by trainers in real time
        self._perf = perf_clock
        self.monitors: dict[str, RunMonitor] = {}
        self._last_seen: dict[
            str, tuple[datetime, datetime]
        ] = {}  # run -> (newest event ts, when it arrived)
        self._partition: dict[str, int] = {}  # run -> the telemetry partition its events come from
        self._tick_order: deque[str] = deque()  # runs in the order the next tick judges them
        # After run_end a multi-rank run is kept this long for its other ranks' last steps.
        self._linger = timedelta(seconds=config.join.timeout_s)
        # Runs let go, by id: what their crashes left (engine/crashes.py), for their next attempt's monitor.
        # In memory only: a worker restart forgets it (docs/limitations.md).
        self._crash_histories: OrderedDict[str, CrashHistory] = OrderedDict()
        self.counters = WorkerCounters()
        # run -> rank -> its last step's event time, for the metrics (step_times.py); forgotten with the run
        self.step_times = StepTimes()
        options = state or StateOptions()
        self._reader = state_reader if options.enabled else None
        if self._reader is not None:
            if state_secret is None:
                raise ValueError("durable state needs the workers' state key (state_secret)")
            resolve_state_secret(state_secret, action_secret=secret)  # long enough, not an action key
        self._state_secret = state_secret or b""
        self.states = RunStates(options, clock, perf_clock) if self._reader is not None else None
        self._config_sha = config_digest(config.model_dump_json())
        self._loaded: set[int] = set()  # telemetry partitions whose runs' state was read back
        self._state_prefix = f"{group}/"
        self._published = Published()  # what predecessors published for the runs restored here
        self._activity = RunActivity()  # runs, least recently active first (run_lifecycle.py)
        # telemetry partition -> the newest record time read from it (a run quiet for runs.active_s against
        # it is inactive: eviction's order)
        self._frontier: dict[int | None, datetime] = {}
        # What runs let go keep for a rollback when they come back, the oldest first (run_lifecycle.py)
        self._ledgers: OrderedDict[str, KeptLedger] = OrderedDict()
        # The telemetry topic's id (where the broker reports one), as the worker last checked it: the log
        # the offsets handled here belong to (a snapshot of another is not restored as it is)
        self.log_id: str | None = None
        # run -> (partition, newest offset judged): a record at or below it is one read again, never judged
        # twice (a new attempt's monitor must not take the old attempt's events for its own)
        self._judged_to: dict[str, tuple[int, int]] = {}
        self._let_go: list[
            Anomaly
        ] = []  # findings of runs let go outside a request's result, sent with the next tick
        self._evictions_unlogged, self._evictions_logged_at = 0, float("-inf")
        # Called about once a second while partitions are restored (the detector process tells its parent)
        self.on_restore_progress: Callable[[dict[str, Any]], None] | None = None

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

    def _already_judged(self, run_id: str, partition: int | None, offset: int | None) -> bool:
        judged = self._judged_to.get(run_id)
        return judged is not None and offset is not None and judged[0] == partition and offset <= judged[1]

    def _forget(self, run_id: str, why: str) -> None:
        """Let the run go: it ``ended``, was ``reset`` (a detector error), ``moved`` to another worker,
        ``restarted`` under its id, was let go (``silent``, ``evicted``) or held a snapshot of a recreated
        log (``stale``). What its snapshot becomes follows (run_states.py)."""
        self._keep_crash_history(run_id, self.monitors.pop(run_id, None))
        self.step_times.forget(run_id)
        self._last_seen.pop(run_id, None)
        self._partition.pop(run_id, None)
        if why != "restarted":  # (a new attempt follows at once, and the old one's events stay behind it)
            self._judged_to.pop(run_id, None)
        self._published.forget(run_id)
        self._activity.forget(run_id)
        # (_tick_order drops it lazily)
        if self.states is not None:
            if why in ("silent", "evicted", "stale"):
                self.states.let_go(run_id, ledger=run_id in self._ledgers)
                return
            {
                "ended": self.states.ended_run,
                "reset": self.states.dropped,
                "moved": self.states.moved,
                "restarted": self.states.moved,
            }[why](run_id)

    def _make_room(self, coming: int) -> None:
        """Let runs go until ``coming`` more fit under ``runs.max_runs``: those that never stepped first,
        then inactive ones, then those without a confirmed-good checkpoint (run_lifecycle.py)."""
        excess = len(self.monitors) + coming - self.config.runs.max_runs
        if excess <= 0:
            return
        runs = self.config.runs
        held = runs.max_runs
        self._evictions_unlogged += excess
        if self._perf() - self._evictions_logged_at >= EVICTION_LOG_EVERY_S:  # (a flood would fill the log)
            log.warning(
                "holding runs.max_runs (%d) runs: %d let go for new ones (those that never stepped, then "
                "inactive ones, then those without a confirmed-good checkpoint first)",
                held,
                self._evictions_unlogged,
            )
            self._evictions_unlogged, self._evictions_logged_at = 0, self._perf()
        active = timedelta(seconds=runs.active_s)

        def inactive(run_id: str) -> bool:
            sent, newest = self._activity.sent(run_id), self._frontier.get(self._partition.get(run_id))
            return sent is not None and newest is not None and newest - sent > active

        victims = self._activity.victims(excess, inactive)
        for run_id, why in victims:
            monitor = self.monitors.get(run_id)
            kept = monitor is not None and monitor.ledger() is not None and runs.max_ledgers > 0
            message = eviction_message(held, why, runs.active_s, kept)
            self._let_go.append(self._lifecycle(run_id, "evicted", message, value=float(held), evidence=why))

    # -- what runs let go keep -------------------------------------------------------------------

    def _keep_crash_history(self, run_id: str, monitor: RunMonitor | None) -> None:
        ledger = getattr(monitor, "crash_ledger", None)
        history = ledger() if ledger is not None else None
        if history is not None:
            self._remember_crash_history(run_id, history)

    def _remember_crash_history(self, run_id: str, history: CrashHistory) -> None:
        self._crash_histories.pop(run_id, None)
        self._crash_histories[run_id] = history
        while len(self._crash_histories) > MAX_CRASH_HISTORIES:
            self._crash_histories.popitem(last=False)

    def _keep_ledger(self, run_id: str, ledger: RunLedger, partition: int | None, at: datetime) -> None:
        """Keep ``ledger`` for the run's return, within ``runs.max_ledgers`` (the oldest goes first)."""
        limit = self.config.runs.max_ledgers
        if limit <= 0:
            return
        self._ledgers.pop(run_id, None)
        self._ledgers[run_id] = KeptLedger(ledger, partition, at)
        while len(self._ledgers) > limit:
            self._drop_ledger(next(iter(self._ledgers)))
        self.counters.ledgers = len(self._ledgers)

    def _drop_ledger(self, run_id: str) -> None:
        kept = self._ledgers.pop(run_id)
        if self.states is not None and kept.partition is not None:
            self.states.ledger_gone(run_id, kept.partition)
        self.counters.ledgers = len(self._ledgers)

    def _expire_ledgers(self, now: datetime) -> None:
        retention = timedelta(seconds=self.config.runs.ledger_retention_s)
        while self._ledgers:
            run_id, kept = next(iter(self._ledgers.items()))
            if now - kept.let_go_at <= retention:
                return  # (kept in the order they were let go)
            self._drop_ledger(run_id)

    def _resume_ledger(self, monitor: RunMonitor, event: TelemetryEvent) -> None:
        """A run back after it was let go takes on what it kept (not a new attempt of it: that starts
        fresh, with a budget of its own)."""
        kept = self._ledgers.pop(monitor.run_id, None)
        self.counters.ledgers = len(self._ledgers)
        if kept is None:
            return
        ledger = kept.ledger
        if isinstance(event, RunStartEvent) and event.attempt is not None and event.attempt != ledger.attempt:
            return
        monitor.take_ledger(ledger)
        self.counters.ledgers_resumed += 1
        log.info(
            "run %s: back after it was let go: its checkpoint ledger (%d confirmed-good) and %d rollback(s) "
            "spent taken on",
            monitor.run_id,
            len(ledger.good),
            ledger.rollbacks,
        )

    def _lifecycle(
        self,
        run_id: str,
        why: str,
        message: str,
        value: float | None = None,
        threshold: float | None = None,
        ts: datetime | None = None,
        evidence: str | None = None,
    ) -> Anomaly:
        """Let ``run_id`` go for ``why`` (``silent``, ``evicted``; ``evidence``: which of eviction's
        reasons); the info finding that says so. What a rollback needs is kept (its ledger)."""
        monitor = self.monitors.get(run_id)
        seen = self._last_seen.get(run_id)
        ts = ts or (seen[0] if seen is not None else self._clock())
        finding = lifecycle_finding(
            parse_key(run_id)[0],  # (a split run's group is let go: the finding is about its run)
            why,
            message,
            step=monitor.last_step if monitor else None,
            ts=ts,
            value=value,
            threshold=threshold,
            reason=evidence,
        ).model_copy(update={"detected_at": self._clock()})
        self.counters.runs_let_go[why] += 1
        log.debug("run %s: %s", run_id, message)  # (the finding says it; a flood would fill the log)
        ledger = monitor.ledger() if monitor is not None else None
        if ledger is not None:
            self._keep_ledger(run_id, ledger, self._partition.get(run_id), self._clock())
        self._forget(run_id, why)
        return finding

    def _reset_run(
        self,
        run_id: str,
        exc: BaseException,
        raw: bytes | None,
        key: bytes | None,
        partition: int | None,
        offset: int | None,
    ) -> ProcessResult:
        """A detector raised: drop the run's state (its detectors re-warm from the next event) and
        dead-letter a ``detector_error`` with the traceback; every other run goes on."""
        self.counters.detector_errors += 1
        self._forget(run_id, "reset")
        trace = traceback.format_exc()
        log.error("detector error on run %s (its state is reset): %r", run_id, exc)
        letter = DeadLetter.for_message(
            f"detector_error: {type(exc).__name__}: {exc}",
            raw,
            source_topic=topics.TELEMETRY,
            partition=partition,
            offset=offset,
            key=key if key is not None else run_id.encode(),
            stage="detector",
            traceback=trace,
        )
        return ProcessResult(errors=[letter])

    def keep_partitions(self, partitions: set[int], log_id: str | None = None) -> list[str]:
        """After a rebalance: drop the runs whose partition this worker no longer owns (their new
        owner rebuilds them), so timers only ever judge runs this worker holds. Returns them.
        ``log_id``: the telemetry topic's id as the worker sees it now (None: not known)."""
        if log_id is not None:
            self.log_id = log_id
        dropped = [run for run, p in self._partition.items() if p not in partitions]
        for run in dropped:
            self._forget(run, "moved")
        for run in [r for r, k in self._ledgers.items() if k.partition not in partitions | {None}]:
            del self._ledgers[run]  # (its new owner reads it back)
        self.counters.ledgers = len(self._ledgers)
        if self.states is not None:
            self.states.moved_partitions(partitions)
            self._loaded &= partitions
            # (now, so that a silent restored run is still judged by the timer)
            self.load_partitions(partitions)
        return dropped

    def log_recreated(self, partitions: set[int], log_id: str | None = None) -> list[str]:
        """The telemetry log of ``partitions`` was recreated (a new topic id, or a log that ends below
        what was read from it): the worker reads it again from its beginning. The runs held keep their
        state (what this worker judged is theirs) but forget their offsets, which are the old log's: no
        event of the new log is taken for one a snapshot includes, and each run is snapshotted again
        with positions of the new log. A run restored from a snapshot that named no log (a broker without
        topic ids) and fed nothing since holds the old log's snapshot: it is dropped, its ledger kept.
        Returns the runs dropped."""
        if log_id is not None:
            self.log_id = log_id
        self.counters.logs_recreated += len(partitions)
        self._judged_to = {r: j for r, j in self._judged_to.items() if j[0] not in partitions}
        if self.states is None:
            return []
        stale = self.states.log_recreated(partitions)
        for run_id in stale:
            monitor = self.monitors[run_id]
            ledger = monitor.ledger()
            if ledger is not None:
                self._keep_ledger(run_id, ledger, self._partition.get(run_id), self._clock())
            self._forget(run_id, "stale")
        self.counters.stale_snapshots += len(stale)
        self.counters.runs = len(self.monitors)
        log.warning(
            "%s partition(s) %s recreated: their runs' offsets forgotten (%d run(s) restored from a "
            "snapshot of the old log dropped, their checkpoint ledgers kept)",
            topics.TELEMETRY,
            sorted(partitions),
            len(stale),
        )
        return stale

    # -- durable state ---------------------------------------------------------------------------

    def load_partitions(self, partitions: set[int]) -> None:
        """Restore the runs of telemetry ``partitions`` not read back yet, before any of their events
        is handled. An unreadable record is logged and its run starts fresh."""
        new = partitions - self._loaded
        if not new or self._reader is None or self.states is None:
            return
        self._loaded |= new
        started = self._perf()
        restored: list[str] = []
        progress = RestoreProgress(sorted(new), self._perf, self.on_restore_progress)
        if hasattr(self._reader, "on_progress"):
            self._reader.on_progress = progress.reading
        records = self._reader.read(new)
        stale = 0
        for key, raw in records.items():
            progress.restoring(len(restored), len(records))
            if not key.startswith(self._state_prefix):
                continue  # another group's
            run_id = key[len(self._state_prefix) :]
            if raw is None or run_id in self.monitors:
                continue  # a tombstone; or a run already live here (its state is newer than any record)
            try:
                header, body = decode_header(raw, self._state_secret)
                if header.run_id != run_id:
                    raise SnapshotError(
                        f"a state record of run {header.run_id!r} under the key of {run_id!r}"
                    )
                if header.partition not in new:
                    continue
                if header.let_go_at is not None:  # a run let go: its ledger (whatever the config)
                    ledger = decode_body(body)
                    if not isinstance(ledger, RunLedger):
                        raise SnapshotError(f"a ledger record holding {type(ledger).__name__}, not a ledger")
                    self._restore_ledger(run_id, ledger, header.partition, header.let_go_at)
                    continue
                if header.config_sha != self._config_sha:
                    log.warning(
                        "run %s: its snapshot was taken under another detector config: it starts fresh",
                        run_id,
                    )
                    continue
                if header.ended_at is not None:
                    self.states.restored_marker(run_id, header.partition, header.ended_at)
                    history = decode_body(body)  # (what its crashes left, for its next attempt; or None)
                    if isinstance(history, CrashHistory):
                        self._remember_crash_history(run_id, history)
                    continue
                state = decode_body(body)
                if not isinstance(state, RunState) or not isinstance(state.monitor, RunMonitor):
                    raise SnapshotError(f"a state record holding {type(state).__name__}, not a run's state")
            except SnapshotError as exc:
                self.counters.restore_failures += 1
                log.error(
                    "run %s: its state record %s cannot be read (%s): the run starts fresh",
                    run_id,
                    self._where(key),
                    exc,
                )
                continue
            if header.log_id is not None and self.log_id is not None and header.log_id != self.log_id:
                # taken on a telemetry log that is gone (the topic was recreated since): its offset says
                # nothing of the new log, whose every event is judged; the run starts fresh with its ledger
                stale += 1
                ledger = state.monitor.ledger()
                if ledger is not None:
                    self._restore_ledger(run_id, ledger, header.partition, self._clock())
                    self.states.keep_ledger(run_id, header.partition)
                log.warning(
                    "run %s: its snapshot %s was taken on another %s log (topic id %s, now %s: recreated): "
                    "not restored; the run starts fresh%s",
                    run_id,
                    self._where(key),
                    topics.TELEMETRY,
                    header.log_id,
                    self.log_id,
                    " with its checkpoint ledger" if ledger is not None else "",
                )
                continue
            self.monitors[run_id] = state.monitor
            self._tick_order.append(run_id)
            self._partition[run_id] = header.partition
            if state.last_seen is not None:
                # its clock resumes from now: the time no worker held the run is not the run's silence
                self._last_seen[run_id] = (state.last_seen[0], self._clock())
            verified = header.log_id is not None and self.log_id is not None
            self.states.restored(run_id, header.partition, header.offset, verified=verified)
            monitor = state.monitor
            self._activity.seen(
                run_id, self._clock(), monitor.last_step is not None, bool(monitor.checkpoints.good)
            )
            restored.append(run_id)
        if restored:  # their predecessor may have published more than its last snapshot knows of
            self._published.update(read_published(self._reader.scan, restored))
            self._make_room(0)  # (more partitions than the predecessor held may bring more runs than fit)
        self.counters.restored_runs += len(restored)
        self.counters.stale_snapshots += stale
        self.counters.runs = len(self.monitors)
        progress.done(len(restored), len(records))
        log.info(
            "restored %d run(s) of telemetry partition(s) %s in %.3f s",
            len(restored),
            sorted(new),
            self._perf() - started,
        )

    def _where(self, key: str) -> str:
        """Where the state record of ``key`` the last read returned lies (for a log line)."""
        assert self._reader is not None
        where = self._reader.origin.get(key)
        return f"{self._reader.topic}[{where[0]}]@{where[1]}" if where else f"in {self._reader.topic}"

    def _restore_ledger(self, run_id: str, ledger: RunLedger, partition: int, let_go_at: datetime) -> None:
        """A ledger read back: kept for the run's return, or its record deleted once past its retention."""
        if self._clock() - let_go_at > timedelta(seconds=self.config.runs.ledger_retention_s):
            if self.states is not None:
                self.states.ledger_gone(run_id, partition)
            return
        self._keep_ledger(run_id, ledger, partition, let_go_at)

    def _eventless_record(
        self, run_id: str, partition: int, now: datetime, body: Any, **header: Any
    ) -> StateRecord:
        """A state record that holds no events (offset -1): an ended run's marker (no body) or a let-go
        run's ledger."""
        head = SnapshotHeader(
            run_id=run_id,
            partition=partition,
            offset=-1,
            events=0,
            taken_at=now,
            config_sha=self._config_sha,
            **header,
        )
        return StateRecord(
            self._state_prefix + run_id, partition, encode_snapshot(head, body, self._state_secret)
        )

    def take_snapshots(self, force_checkpoint: bool = False) -> tuple[list[StateRecord], bool]:
        """The state records due now, and whether they make a checkpoint (see run_states.py). Without
        durable state nothing is written and every request is a checkpoint."""
        if self.states is None:
            return [], True
        due = self.states.due(force_checkpoint)
        now = self._clock()
        records = []
        for run_id in due.runs:
            run, monitor = self.states.runs[run_id], self.monitors.get(run_id)
            if monitor is None or run.partition is None:
                continue
            header = SnapshotHeader(
                run_id=run_id,
                partition=run.partition,
                offset=run.last_offset,
                events=monitor.events_seen,
                taken_at=now,
                config_sha=self._config_sha,
                log_id=self.log_id,
            )
            try:
                value = encode_snapshot(
                    header, RunState(monitor, self._last_seen.get(run_id)), self._state_secret
                )
            except Exception as exc:  # noqa: BLE001 - a detector whose state does not pickle: no snapshot
                self.counters.snapshot_failures += 1
                log.error("run %s: its state was not snapshotted: %r", run_id, exc)
                continue
            if len(value) > topics.STATE_MAX_BYTES:
                self.counters.snapshot_failures += 1
                log.error(
                    "run %s: its snapshot is %d bytes, over the %d-byte record limit: not written (a new "
                    "owner would re-warm it)",
                    run_id,
                    len(value),
                    topics.STATE_MAX_BYTES,
                )
                continue
            records.append(StateRecord(self._state_prefix + run_id, run.partition, value))
            self.states.written(run_id)
            self.counters.snapshots += 1
            self.counters.snapshot_bytes += len(value)
        for run_id, partition, ended_at in due.markers:
            history = self._crash_histories.get(run_id)  # (a restarted worker must still know its crashes)
            records.append(self._eventless_record(run_id, partition, now, history, ended_at=ended_at))
        for run_id, partition in due.ledgers:
            kept = self._ledgers.get(run_id)
            if kept is None:
                continue  # (gone meanwhile: its tombstone is due)
            records.append(
                self._eventless_record(
                    run_id, partition, now, kept.ledger, let_go_at=kept.let_go_at, log_id=self.log_id
                )
            )
        records.extend(
            StateRecord(self._state_prefix + run_id, partition, None) for run_id, partition in due.tombstones
        )
        return records, due.checkpoint

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

    def _silent_runs(self, now: datetime, behind: set[int] | frozenset[int]) -> list[Anomaly]:
        """Let go of the runs that have sent nothing for ``runs.silence_retention_s`` (not those of partitions
        this worker is behind on: their events may be waiting to be read)."""
        retention_s = self.config.runs.silence_retention_s
        lagging = [r for r, p in self._partition.items() if p in behind] if behind else ()
        silent = list(self._activity.silent(now, timedelta(seconds=retention_s), skip=lagging))
        if silent:
            log.warning(
                "%d run(s) silent for over %.0f s let go (runs.silence_retention_s); %d held",
                len(silent),
                retention_s,
                len(self.monitors) - len(silent),
            )
        out = []
        for run_id in silent:
            event_ts, arrived = self._last_seen.get(run_id, (now, now))
            quiet_s = (now - arrived).total_seconds()
            monitor = self.monitors.get(run_id)
            kept = monitor is not None and monitor.ledger() is not None and self.config.runs.max_ledgers > 0
            out.append(
                self._lifecycle(
                    run_id,
                    "silent",
                    silence_message(quiet_s, retention_s, kept),
                    value=quiet_s,
                    threshold=retention_s,
                    ts=event_ts + (now - arrived),
                )
            )
        return out

    def _result(self, out: MonitorOutput, monitor: RunMonitor | None = None) -> ProcessResult:
        # detected_at: this worker's wall clock when the monitor produced them (the monitor has no clock;
        # their ts is the event time of what they are about), so detected_at - ts is the detection latency.
        detected = self._clock() if out.anomalies else None
        anomalies = [a.model_copy(update={"detected_at": detected}) for a in out.anomalies]
        actions = [self._action(d) for d in out.decisions]
        if self._published:  # (a restored run's predecessor published something)
            anomalies, actions = self._not_published(anomalies), self._not_published(actions)
        result = ProcessResult(anomalies=anomalies, actions=actions, joined=out.joined)
        if out.report and isinstance(monitor, GroupMonitor):
            result.reports += signed_reports(monitor, out.report, self._clock(), self._signing_key)
        self.counters.anomalies += len(result.anomalies)
        for anomaly in result.anomalies:
            self.counters.findings[(anomaly.detector, anomaly.severity)] += 1
            log.info(
                "anomaly run=%s step=%s %s: %s",
                anomaly.run_id,
                anomaly.step,
                anomaly.detector,
                anomaly.message,
            )
        for action in result.actions:
            self.counters.actions[action.kind] += 1
            log.info("action run=%s %s (%s)", action.run_id, action.kind, action.reason)
        return result

    def _not_published(self, records: list[_Published]) -> list[_Published]:
        """Leave out what a predecessor already published as it is (published.py)."""
        kept = []
        for record in records:
            if self._published.is_repeat(record):
                self.counters.repeats_withheld += 1
                log.info(
                    "run %s: %s already published before this worker restored the run: not sent again",
                    record.run_id,
                    record.anomaly_id if isinstance(record, Anomaly) else record.action_id,
                )
            else:
                kept.append(record)
        return kept

    def _action(self, decision: ActionDecision) -> Action:
        issued = self._clock()
        action = Action(
            action_id=decision.action_id,
            run_id=decision.run_id,
            kind=decision.kind,
            reason=decision.reason,
            anomaly_ids=decision.anomaly_ids,
            step=decision.step,
            onset_step=decision.onset_step,
            target_checkpoint=decision.target_checkpoint,
            params=self._with_job(decision),
            attempt=decision.attempt,
            issued_at=issued,
            expires_at=action_expiry(issued, self.config.policy.action_ttl_s),
        )
        return self._signing_key.sign(action)

    def _with_job(self, decision: ActionDecision) -> dict[str, Any]:
        """The run's job_id, host and pod (from its run_start, which the decision carries) join the action's
        params, signed with it, and the offsets of the ranks whose clocks are ahead of the worker's
        (``Action.issuer_now``)."""
        job = decision.job
        params = {**job, **decision.params} if job else decision.params
        monitor = self.monitors.get(decision.run_id)
        if monitor is not None and monitor.clock_ahead:  # (ranks whose clock is fast: RunMonitor.clock_seen)
            params = {**params, CLOCK_AHEAD_PARAM: {str(r): s for r, s in monitor.clock_ahead.items()}}
        return params

    @staticmethod
    def _deadletter(
        reason: str, raw: bytes | None, key: bytes | None, partition: int | None, offset: int | None
    ) -> DeadLetter:
        return DeadLetter.for_message(
            reason, raw, source_topic=topics.TELEMETRY, partition=partition, offset=offset, key=key
        )


_CLOCK_SLACK = timedelta(seconds=1)
