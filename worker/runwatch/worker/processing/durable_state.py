"""The runs' durable state: snapshots to ``runwatch.state`` (``run_states.py`` says when,
``runwatch.worker.state.snapshot`` how), restored when this worker is given a run's partition, and what a
rebalance or a recreated telemetry log does to them."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, ClassVar

from runwatch.contract import topics
from runwatch.detectors import RunMonitor
from runwatch.detectors.engine.crashes import CrashHistory
from runwatch.detectors.engine.monitor import RunLedger
from runwatch.worker.processing.outputs import RunOutputs
from runwatch.worker.processing.results import StateRecord
from runwatch.worker.state.published import read_published
from runwatch.worker.state.restore_progress import RestoreProgress
from runwatch.worker.state.snapshot import (
    SnapshotError,
    SnapshotHeader,
    decode_body,
    decode_header,
    encode_snapshot,
)

if TYPE_CHECKING:
    from runwatch.worker.processor import RunState

log = logging.getLogger(__name__)


class DurableState(RunOutputs):
    """Snapshots and restores (TelemetryProcessor's third layer)."""

    # The class a run's snapshot pickles: processor.RunState, set there (existing snapshots name it by its
    # module, which must stay runwatch.worker.processor: state/classes.py)
    _state_type: ClassVar[type[RunState]]

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
                if not isinstance(state, self._state_type) or not isinstance(state.monitor, RunMonitor):
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
                    header, self._state_type(monitor, self._last_seen.get(run_id)), self._state_secret
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
