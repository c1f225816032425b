"""Which runs' state to snapshot, and when; which events a restored run has already seen.

The processor tells ``RunStates`` what happened to each run (an event observed, findings emitted, the
run ended, reset, moved away); ``RunStates`` says which snapshots are due:

- at once, for a run that emitted an anomaly or an action in this request: its findings are then
  never re-emitted by a successor, which restores the state that includes them;
- for a run that saw ``every_events`` events since its last snapshot;
- a **checkpoint** every ``interval_s`` (and when asked, during a rebalance): every run changed since
  its last snapshot, plus the markers and tombstones due. Once a checkpoint's records are delivered,
  every event handled before it is in some snapshot: the worker acknowledges events (their offsets
  may be committed) only then, so a successor that starts at the committed offset misses nothing.

A restored run skips the events at or below its snapshot's offset (read again from the committed
offset, they are already in its state) and replays the rest. A run that ended leaves a marker (no
body) for ``retention_s``, then a tombstone, so compaction forgets it. A run let go without its end
(silence, eviction) leaves its checkpoint ledger (``RunLedger``, a small body) if it kept one, else a
tombstone; the processor tombstones the ledger when it expires (``runs.ledger_retention_s``).

Offsets are one log's: when the telemetry topic is recreated (a broker that lost its data, a topic
deleted and created again), ``log_recreated`` forgets every run's offsets on those partitions, so that
the new log's events are all judged (none is taken for one a snapshot includes), and has them
snapshotted again with positions of the new log.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field


class StateOptions(BaseModel):
    """The worker's state snapshots (``runwatch worker --snapshot-*``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    every_events: int = Field(1000, ge=1, description="snapshot a run after this many events since its last")
    interval_s: float = Field(
        5.0, gt=0, description="checkpoint every run changed since its last snapshot this often"
    )
    retention_s: float = Field(
        3600.0, ge=0, description="an ended run's marker is kept this long, then deleted"
    )


@dataclass
class _Run:
    partition: int | None
    last_offset: int = -1  # the newest telemetry offset observed
    covered: int = -1  # restored from a snapshot that includes every event up to this offset
    since_snapshot: int = 0
    dirty: bool = False
    # its state is known to be of the log being read (False: restored from a snapshot whose log could not
    # be checked, a broker without topic ids, and no event observed since)
    verified: bool = True


@dataclass(frozen=True)
class Due:
    """What to write now: snapshots of ``runs``, ended markers, tombstones; ``checkpoint``: everything
    handled so far is covered once these are delivered."""

    runs: list[str]
    markers: list[tuple[str, int, datetime]]  # (run, partition, ended at)
    tombstones: list[tuple[str, int]]  # (run, partition)
    checkpoint: bool
    ledgers: list[tuple[str, int]] = field(default_factory=list)  # (run, partition): a let-go run's ledger


class RunStates:
    def __init__(self, options: StateOptions, clock: Callable[[], datetime], perf: Callable[[], float]):
        self.options = options
        self._clock = clock
        self._perf = perf
        self.runs: dict[str, _Run] = {}
        self.ended: dict[str, tuple[int, datetime]] = {}  # markers kept until retention ends them
        self._new_markers: list[str] = []
        self._tombstones: dict[str, int] = {}
        self._ledgers: dict[str, int] = {}  # runs let go whose ledger record is due, by partition
        self._urgent: set[str] = set()
        self._last_checkpoint = perf()

    # -- what happened --------------------------------------------------------------------------

    def restored(self, run_id: str, partition: int, offset: int, verified: bool = False) -> None:
        """``verified``: the snapshot names the log being read (its topic id)."""
        self.runs[run_id] = _Run(partition, last_offset=offset, covered=offset, verified=verified)

    def restored_marker(self, run_id: str, partition: int, ended_at: datetime) -> None:
        self.ended[run_id] = (partition, ended_at)

    def already_seen(self, run_id: str, partition: int | None, offset: int | None) -> bool:
        """An event read again after a restore that its run's snapshot already includes."""
        run = self.runs.get(run_id)
        return (
            run is not None
            and offset is not None
            and run.covered >= 0
            and partition == run.partition
            and offset <= run.covered
        )

    def observed(self, run_id: str, partition: int | None, offset: int | None, emitted: bool) -> None:
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = _Run(partition)
            self.ended.pop(run_id, None)  # (an ended run started again under its id)
            self._tombstones.pop(run_id, None)
            self._ledgers.pop(run_id, None)  # (a run let go is back: its snapshot replaces the ledger)
        if partition is not None and run.partition is not None and partition != run.partition:
            run.last_offset = -1  # a replay marker is one partition's: another's offsets say nothing of it
        if offset is not None:
            run.last_offset = max(run.last_offset, offset)
        run.partition = partition if partition is not None else run.partition
        run.since_snapshot += 1
        run.dirty = run.verified = True
        if emitted or run.since_snapshot >= self.options.every_events:
            self._urgent.add(run_id)

    def emitted(self, run_id: str) -> None:
        """A timer finding (no event): the state that produced it is written at once."""
        run = self.runs.get(run_id)
        if run is not None:
            run.dirty = True
            self._urgent.add(run_id)

    def ended_run(self, run_id: str) -> None:
        """The worker let the run go after its end: a marker replaces its snapshot."""
        run = self.runs.pop(run_id, None)
        self._urgent.discard(run_id)
        if run is not None and run.partition is not None:
            self.ended[run_id] = (run.partition, self._clock())
            self._new_markers.append(run_id)

    def dropped(self, run_id: str) -> None:
        """The run's state was reset (a detector error): its snapshot goes, so no one restores it."""
        run = self.runs.pop(run_id, None)
        self._urgent.discard(run_id)
        if run is not None and run.partition is not None:
            self._tombstones[run_id] = run.partition

    def let_go(self, run_id: str, ledger: bool) -> None:
        """The run was let go without its end (silence, eviction): its snapshot is replaced by its ledger
        record (``ledger``: it kept one), or deleted."""
        run = self.runs.pop(run_id, None)
        self._urgent.discard(run_id)
        if run is not None and run.partition is not None:
            if ledger:
                self.keep_ledger(run_id, run.partition)
            else:
                self._tombstones[run_id] = run.partition

    def keep_ledger(self, run_id: str, partition: int) -> None:
        """Write a ledger record for a run not held here (its stale snapshot is replaced)."""
        self._tombstones.pop(run_id, None)
        self._ledgers[run_id] = partition

    def ledger_gone(self, run_id: str, partition: int) -> None:
        """A let-go run's ledger expired or was pushed out: its record is deleted (unless the run is back:
        its snapshot replaces it)."""
        self._ledgers.pop(run_id, None)
        if run_id not in self.runs:
            self._tombstones[run_id] = partition

    def moved(self, run_id: str) -> None:
        """Another worker owns the run now: nothing more is written for it here."""
        self.runs.pop(run_id, None)
        self.ended.pop(run_id, None)
        self._urgent.discard(run_id)
        self._tombstones.pop(run_id, None)
        self._ledgers.pop(run_id, None)

    def moved_partitions(self, kept: set[int]) -> None:
        for run_id, (partition, _) in list(self.ended.items()):
            if partition not in kept:
                self.moved(run_id)
        for run_id, partition in list(self._ledgers.items()):
            if partition not in kept:
                self._ledgers.pop(run_id)

    def log_recreated(self, partitions: set[int]) -> list[str]:
        """The telemetry log of ``partitions`` was recreated: their runs' offsets belong to the old log.
        Every run of them is snapshotted again at the next checkpoint (its position is the new log's from
        its next event), the ended markers too. Returns the runs restored from a snapshot and not fed an
        event since, whose snapshot did not name its log: theirs is the old log's (the caller drops them)."""
        stale = []
        for run_id, run in self.runs.items():
            if run.partition in partitions:
                if not run.verified:
                    stale.append(run_id)
                run.last_offset = run.covered = -1
                run.dirty = True
        self._new_markers.extend(r for r, (p, _) in self.ended.items() if p in partitions)
        return stale

    # -- what to write --------------------------------------------------------------------------

    def due(self, force_checkpoint: bool = False) -> Due:
        checkpoint = force_checkpoint or self._perf() - self._last_checkpoint >= self.options.interval_s
        if checkpoint:
            self._last_checkpoint = self._perf()
            runs = [r for r, s in self.runs.items() if s.dirty]
            now = self._clock()
            expired = [
                r
                for r, (_, at) in self.ended.items()
                if now - at >= timedelta(seconds=self.options.retention_s)
            ]
            for run_id in expired:
                self._tombstones[run_id] = self.ended.pop(run_id)[0]
        else:
            runs = [r for r in self._urgent if r in self.runs]
        markers = [(r, *self.ended[r]) for r in dict.fromkeys(self._new_markers) if r in self.ended]
        tombstones = list(self._tombstones.items())
        ledgers = list(self._ledgers.items())
        self._new_markers.clear()
        self._tombstones.clear()
        self._ledgers.clear()
        self._urgent.clear()
        return Due(runs, markers, tombstones, checkpoint, ledgers)

    def written(self, run_id: str) -> None:
        """A snapshot of the run was taken (it is published with this request's records)."""
        run = self.runs.get(run_id)
        if run is not None:
            run.since_snapshot = 0
            run.dirty = False
