"""The runs a worker holds: their monitors and clocks, and letting them go (ended, moved, silent, evicted)
with what they keep for their return (a crash history, a checkpoint ledger: run_lifecycle.py)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from runwatch.contract import topics
from runwatch.contract.groups import parse_key
from runwatch.contract.schema import (
    Anomaly,
    RunStartEvent,
    TelemetryEvent,
    utc_now,
)
from runwatch.contract.signing import ActionPublicKeys, ActionSigningKey
from runwatch.detectors import RunMonitor, RunwatchConfig
from runwatch.detectors.engine.crashes import CrashHistory
from runwatch.detectors.engine.monitor import RunLedger
from runwatch.worker.processing.results import KeptLedger, WorkerCounters
from runwatch.worker.run_lifecycle import (
    RunActivity,
    eviction_message,
    lifecycle_finding,
    silence_message,
)
from runwatch.worker.state.published import Published
from runwatch.worker.state.run_states import RunStates, StateOptions
from runwatch.worker.state.snapshot import (
    config_digest,
    resolve_state_secret,
)
from runwatch.worker.step_times import StepTimes

if TYPE_CHECKING:
    from runwatch.worker.baselines import BaselineLoader
    from runwatch.worker.state.reader import StateReader

log = logging.getLogger(__name__)

EVICTION_LOG_EVERY_S = 10.0  # runs evicted past runs.max_runs are logged as one line at most this often
MAX_CRASH_HISTORIES = 4096  # runs let go whose crashes a worker remembers for their next attempt


class HeldRuns:
    """The processor's state and its runs' lifecycle (the first of TelemetryProcessor's layers)."""

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
