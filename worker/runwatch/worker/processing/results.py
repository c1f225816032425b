"""What the worker's processor hands back (results, state records) and counts."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from runwatch.contract.schema import (
    Action,
    Anomaly,
    DeadLetter,
    GroupReport,
    JoinedStep,
)
from runwatch.detectors.engine.monitor import RunLedger


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
