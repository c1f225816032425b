"""``ClickHouseSink``: writes telemetry, anomalies, actions and dead letters.

One code path for the embedded engine (``chdb:///path``) and a server
(``http(s)://user:pass@host:8123``): clickhouse-connect picks the transport from the DSN.

``store`` is what the sink consumer uses: it never lets one row hold up the others. A row
that cannot be built (a value out of its column's range, a field that cannot be serialised)
or that ClickHouse refuses is reported back with the reason, having stored all the others
(a refused batch is split in halves until the offending rows are found). Only when
ClickHouse cannot be reached at all does it raise ``ClickHouseUnavailable``: then nothing can
be concluded about the rows, and the caller retries the whole batch later.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from runwatch.producer.wire.schema import Action, Anomaly, DeadLetter, EventBase, JoinedStep

if TYPE_CHECKING:
    from runwatch.detectors.baselines.band import BaselineBand
    from runwatch.detectors.baselines.summary import RunSummary
    from runwatch.producer.wire.schema import TelemetryEvent
from runwatch.sinks.migrations import MIGRATIONS

log = logging.getLogger(__name__)

DEFAULT_DSN_PATH = Path(".runwatch") / "clickhouse"
TABLES = ("telemetry", "anomalies", "actions", "deadletter", "joined_steps", "run_summaries")

TELEMETRY_COLUMNS = (
    "event_id", "run_id", "rank", "kind", "ts", "step", "loss", "grad_norm", "step_time_s", "payload",
)
ANOMALY_COLUMNS = (
    "anomaly_id", "run_id", "ts", "step", "rank", "detector", "metric", "value", "threshold", "score",
    "severity", "message", "evidence", "detected_at",
)
ACTION_COLUMNS = (
    "action_id", "run_id", "kind", "reason", "anomaly_ids", "step", "onset_step", "target_step", "target_uri",
    "params", "issued_at", "expires_at",
)
DEADLETTER_COLUMNS = (
    "id", "ts", "source_topic", "partition", "offset", "run_key", "reason", "stage", "size", "sha256", "raw",
    "raw_truncated", "traceback",
)
JOINED_COLUMNS = tuple(name for name in JoinedStep.model_fields if name != "schema_version")
REMEDIATION_COLUMNS = (
    "execution_id", "action_id", "run_id", "kind", "target", "target_key", "argv", "url", "status",
    "exit_code", "output", "started_at", "finished_at",
)


class IntRange(NamedTuple):
    """The values a ClickHouse integer column holds (``type`` as in the migrations)."""

    type: str
    min: int
    max: int


INT32 = IntRange("Int32", -(2**31), 2**31 - 1)
INT64 = IntRange("Int64", -(2**63), 2**63 - 1)
UINT32 = IntRange("UInt32", 0, 2**32 - 1)
UINT64 = IntRange("UInt64", 0, 2**64 - 1)

# Every integer column the sink writes, with the range ClickHouse can hold (arrays: each element).
# Steps and byte counts are Int64, ranks, world sizes and generations UInt32. A value outside is
# refused by the sink before it reaches ClickHouse (the row is dead-lettered, the others stored);
# the worker's validation refuses telemetry well inside these at the edge (producer.schema.WireLimits).
# tests/integration/test_sink_poison.py checks this table against the migrated schema.
COLUMN_BOUNDS: dict[str, dict[str, IntRange]] = {
    "telemetry": {"rank": UINT32, "step": INT64},
    "anomalies": {"step": INT64, "rank": UINT32},
    "actions": {"step": INT64, "onset_step": INT64, "target_step": INT64},
    "deadletter": {"partition": INT32, "offset": INT64, "size": UINT64},
    "joined_steps": {
        "step": INT64, "generation": UINT32, "world_size": UINT32, "ranks_reported": UINT32, "ranks_missing": UINT32,
        "step_time_max_rank": UINT32, "compute_max_rank": UINT32, "memory_max_bytes": INT64,
        "memory_max_rank": UINT32, "memory_min_bytes": INT64, "memory_min_rank": UINT32, "late_events": UINT64,
        "duplicate_events": UINT64,
    },
}

REASON_MAX_CHARS = 500  # of ClickHouse's error message in a dead letter's reason


class ClickHouseUnavailable(Exception):  # noqa: N818 - a state, not a bug
    """ClickHouse cannot be reached (connection refused, timeout, client closed): retry later."""


@dataclass
class StoreResult:
    """What ``ClickHouseSink.store`` did: rows stored, and the items refused as (index, reason)."""

    stored: int = 0
    refused: list[tuple[int, str]] = field(default_factory=list)


def default_dsn() -> str:
    return f"chdb://{DEFAULT_DSN_PATH.resolve()}"


# Tables whose rows expire by their ``ts`` (``TTL toDateTime(ts) + INTERVAL n DAY`` in sinks/migrations.py)
RETENTION_DAYS = {"telemetry": 90, "joined_steps": 90, "deadletter": 30}
# toDateTime in those TTLs is 32-bit seconds: a later ts would be stored as another time
LAST_STORABLE_TS = datetime(2106, 2, 7, tzinfo=UTC)


def storable_time(table: str, ts: datetime, now: datetime) -> str | None:
    """Why a row of ``table`` dated ``ts`` would not be kept as sent (None: it would): older than the
    table's retention (ClickHouse would delete it at once), or past what its TTL can represent."""
    days = RETENTION_DAYS.get(table)
    if days is not None and ts < now - timedelta(days=days):
        return (f"ts: {ts.isoformat()} is older than the {table} table's {days}-day retention: it would be "
                "deleted as soon as stored")
    if ts >= LAST_STORABLE_TS:
        return f"ts: {ts.isoformat()} is past {LAST_STORABLE_TS.date()}, the last time the {table} table can hold"
    return None


def as_utc(ts: datetime) -> datetime:
    """``ts`` with UTC as its zone if it has none (ClickHouse's DateTime64 columns are UTC)."""
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def _unique(rows: Iterable[tuple], key_index: int = 0) -> list[tuple]:
    seen: dict[Any, tuple] = {}
    for row in rows:
        seen.setdefault(row[key_index], row)
    return list(seen.values())


def _text(raw: bytes | bytearray | memoryview | str) -> str:
    if isinstance(raw, str):
        return raw
    return bytes(raw).decode("utf-8", errors="replace")


def _first_line(text: str, limit: int = REASON_MAX_CHARS) -> str:
    line = next((part.strip() for part in str(text).splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def error_reason(exc: BaseException) -> str:
    """A one-line reason for a refused row: the error's type and the first line of its message
    (clickhouse-connect's client-side ``DataError`` says which column; its cause says why)."""
    message = _first_line(str(exc))
    reason = f"{type(exc).__name__}: {message}"
    cause = exc.__cause__
    detail = _first_line(str(cause), 200) if cause is not None else ""
    if detail and detail not in message and message not in detail:
        kind = type(cause)
        name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
        reason += f" ({name}: {detail})"
    return reason


def out_of_bounds(table: str, columns: Sequence[str], row: Sequence[Any]) -> str | None:
    """Why ``row`` cannot be stored in ``table`` as it stands (an integer outside its column's
    range, a non-integer in an integer column), or None."""
    bounds = COLUMN_BOUNDS.get(table, {})
    for name, value in zip(columns, row, strict=True):
        bound = bounds.get(name)
        if bound is None or value is None:
            continue
        for v in value if isinstance(value, list | tuple) else (value,):
            if not isinstance(v, int):
                return f"{table}.{name}: {type(v).__name__} {_first_line(repr(v), 100)} in a {bound.type} column"
            if not bound.min <= v <= bound.max:
                shown = str(v) if v.bit_length() <= 256 else f"an integer of {v.bit_length()} bits"
                return f"{table}.{name}: {shown} is out of range for {bound.type} [{bound.min}, {bound.max}]"
    return None


# -- rows (each may raise: a value that cannot be serialised is a fault of that row alone) ---------

def event_row(e: EventBase, raw: bytes | str | None = None) -> tuple:
    """The telemetry row of ``e``; ``payload`` is ``raw`` (the bytes received, as UTF-8 text) when
    given, else ``e`` re-serialised (for events made in process, never received)."""
    payload = _text(raw) if raw is not None else e.to_json().decode()
    return (
        e.event_id, e.run_id, e.rank, e.kind, as_utc(e.ts),
        getattr(e, "step", None), getattr(e, "loss", None), getattr(e, "grad_norm", None),
        getattr(e, "step_time_s", None), payload,
    )


def anomaly_row(a: Anomaly) -> tuple:
    return (a.anomaly_id, a.run_id, as_utc(a.ts), a.step, a.rank, a.detector, a.metric, a.value, a.threshold,
            a.score, a.severity, a.message, orjson.dumps(a.evidence, default=str).decode(),
            as_utc(a.detected_at) if a.detected_at is not None else None)


def action_row(a: Action) -> tuple:
    target = a.target_checkpoint
    return (
        a.action_id, a.run_id, a.kind, a.reason, list(a.anomaly_ids), a.step, a.onset_step,
        target.step if target else None, target.uri if target else None,
        orjson.dumps(a.params, default=str).decode(), as_utc(a.issued_at), as_utc(a.expires_at),
    )


def deadletter_id(d: DeadLetter) -> str:
    """Stable per message and stage, so that a re-delivered dead letter replaces its earlier copy.
    (Letters of stage ``decode`` keep the id they had before stages existed.)"""
    ident = f"{d.source_topic}|{d.partition}|{d.offset}|{d.raw}"
    if d.stage != "decode":
        ident += f"|{d.stage}"
    return hashlib.sha1(ident.encode(errors="replace")).hexdigest()


def deadletter_row(d: DeadLetter) -> tuple:
    return (deadletter_id(d), as_utc(d.ts), d.source_topic, d.partition, d.offset, d.key, d.reason, d.stage, d.size,
            d.sha256, d.raw, d.raw_truncated, d.traceback)


def joined_row(j: JoinedStep) -> tuple:
    return tuple(as_utc(j.ts) if c == "ts" else getattr(j, c) for c in JOINED_COLUMNS)


def _joined_key(row: tuple) -> tuple:
    return (row[0], row[2], row[1])  # (run_id, generation, step)


SUMMARY_COLUMNS = (
    "run_id", "baseline_key", "git_sha", "git_dirty", "commit_time", "fingerprint", "fingerprint_parts", "config_hash",
    "dataset_version", "new_baseline", "started_at", "ended_at", "status", "metrics",
)
NO_TIME = datetime(1970, 1, 1, tzinfo=UTC)  # started_at of a summary that has none (the column is not nullable)


def summary_row(s: RunSummary, written_at: datetime) -> tuple:
    """The ``run_summaries`` row of ``s``: absent text is '' (the columns are not nullable), a
    missing figure an absent key of ``metrics``."""
    return (
        s.run_id, s.baseline_key or "", s.git_sha or "", s.git_dirty,
        as_utc(s.commit_time) if s.commit_time is not None else None, s.fingerprint, dict(s.fingerprint_parts),
        s.config_hash or "", s.dataset_version or "", s.new_baseline,
        as_utc(s.started_at) if s.started_at is not None else NO_TIME,
        as_utc(s.ended_at) if s.ended_at is not None else None, s.status,
        {k: float(v) for k, v in s.metrics.items() if v is not None}, written_at,
    )


def summary_from_row(row: Sequence[Any]) -> RunSummary:
    from runwatch.detectors.baselines.summary import RunSummary

    d = dict(zip(SUMMARY_COLUMNS, row, strict=True))
    for name in ("baseline_key", "git_sha", "config_hash", "dataset_version"):
        d[name] = d[name] or None
    for name in ("commit_time", "started_at", "ended_at"):
        d[name] = as_utc(d[name]) if d[name] is not None else None
    if d["started_at"] == NO_TIME:
        d["started_at"] = None
    d["metrics"] = {str(k): float(v) for k, v in d["metrics"].items()}
    return RunSummary.model_validate(d)


@dataclass(frozen=True)
class _Table:
    columns: tuple[str, ...]
    build: Callable[[Any], tuple]
    key: Callable[[tuple], Any]
    keep_last: bool = False  # of rows with one key in a batch, store the last (else the first)


_TABLE_SPECS: dict[str, _Table] = {
    "telemetry": _Table(TELEMETRY_COLUMNS, lambda item: event_row(*item), lambda r: r[0]),
    "anomalies": _Table(ANOMALY_COLUMNS, anomaly_row, lambda r: r[0]),
    "actions": _Table(ACTION_COLUMNS, action_row, lambda r: r[0]),
    "deadletter": _Table(DEADLETTER_COLUMNS, deadletter_row, lambda r: r[0]),
    "joined_steps": _Table(JOINED_COLUMNS, joined_row, _joined_key, keep_last=True),
}

# Errors raised on our side while serialising rows for an insert: the data is at fault, never the
# connection (clickhouse-connect raises DataError for a value its column type cannot hold).
_CLIENT_ROW_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OverflowError, struct.error, RecursionError)
try:
    from clickhouse_connect.driver.exceptions import DataError as _DataError

    _CLIENT_ROW_ERRORS += (_DataError,)
except ImportError:  # pragma: no cover - clickhouse-connect is a dependency
    pass


class ClickHouseSink:
    def __init__(self, dsn: str | None = None, database: str = "runwatch"):
        import clickhouse_connect

        self.dsn = dsn or default_dsn()
        if self.dsn.startswith("chdb://"):
            Path(self.dsn.removeprefix("chdb://")).mkdir(parents=True, exist_ok=True)
        if not database.isidentifier():
            raise ValueError(f"database name {database!r} is not a plain identifier")
        self.database = database
        self.client = clickhouse_connect.get_client(dsn=self.dsn)

    def close(self) -> None:
        self.client.close()

    # -- schema -----------------------------------------------------------------------

    def migrate(self) -> list[int]:
        """Apply every migration not yet recorded; returns the versions applied now."""
        db = self.database
        self.client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
        self.client.command(
            f"CREATE TABLE IF NOT EXISTS {db}.schema_migrations "
            "(version UInt32, name String, applied_at DateTime64(3, 'UTC')) "
            "ENGINE = ReplacingMergeTree ORDER BY version"
        )
        done = {row[0] for row in self.client.query(f"SELECT version FROM {db}.schema_migrations").result_rows}
        applied = []
        for migration in MIGRATIONS:
            if migration.version in done:
                continue
            for statement in migration.statements:
                self.client.command(statement.format(db=db))
            self.client.insert(
                f"{db}.schema_migrations",
                [[migration.version, migration.name, datetime.now(UTC)]],
                column_names=["version", "name", "applied_at"],
            )
            applied.append(migration.version)
        return applied

    def schema_version(self) -> int:
        rows = self.client.query(f"SELECT max(version) FROM {self.database}.schema_migrations").result_rows
        return int(rows[0][0]) if rows else 0

    # -- writes (each idempotent on its id) -----------------------------------------------

    def _insert(self, table: str, rows: list[tuple], columns: Sequence[str]) -> int:
        if rows:
            self.client.insert(f"{self.database}.{table}", rows, column_names=list(columns))
        return len(rows)

    def write_events(self, events: Iterable[EventBase], raws: Iterable[bytes | str | None] | None = None) -> int:
        """Store telemetry events; ``raws`` (parallel to ``events``) are the bytes each was received
        as, stored as its ``payload``. Without them (events made in process) the payload is the
        event re-serialised."""
        events = list(events)
        raw_list = list(raws) if raws is not None else [None] * len(events)
        if len(raw_list) != len(events):
            raise ValueError(f"{len(events)} events but {len(raw_list)} raw values")
        rows = [event_row(e, raw) for e, raw in zip(events, raw_list, strict=True)]
        return self._insert("telemetry", _unique(rows), TELEMETRY_COLUMNS)

    def write_anomalies(self, anomalies: Iterable[Anomaly]) -> int:
        return self._insert("anomalies", _unique(anomaly_row(a) for a in anomalies), ANOMALY_COLUMNS)

    def write_actions(self, actions: Iterable[Action]) -> int:
        return self._insert("actions", _unique(action_row(a) for a in actions), ACTION_COLUMNS)

    def write_deadletters(self, letters: Iterable[DeadLetter]) -> int:
        return self._insert("deadletter", _unique(deadletter_row(d) for d in letters), DEADLETTER_COLUMNS)

    def write_joined(self, joined: Iterable[JoinedStep]) -> int:
        rows = list({_joined_key(r): r for r in (joined_row(j) for j in joined)}.values())  # the newest
        return self._insert("joined_steps", rows, JOINED_COLUMNS)

    def write_remediation(self, row: Sequence[Any]) -> None:
        """One command run or webhook post of the remediator, in ``REMEDIATION_COLUMNS`` order."""
        row = tuple(as_utc(v) if c in ("started_at", "finished_at") else v
                    for c, v in zip(REMEDIATION_COLUMNS, row, strict=True))
        self._insert("remediations", [row], REMEDIATION_COLUMNS)

    # -- writes that isolate refused rows (the sink consumer's) ---------------------------------

    def store(self, table: str, items: Sequence[Any]) -> StoreResult:
        """Store ``items`` in ``table`` and report those that cannot be stored, never blocking the rest.

        ``items`` are what the ``write_*`` method of the table takes; for ``telemetry``,
        ``(event, raw)`` pairs (``raw``: the bytes received). An item is refused, with a one-line
        reason, when its row cannot be built (a value cannot be serialised, an integer is outside
        its column's range: ``COLUMN_BOUNDS``) or ClickHouse refuses it (found by splitting the
        batch). Items with the same key share one row (the tables deduplicate on it anyway) and its
        verdict. Raises ``ClickHouseUnavailable`` if ClickHouse cannot be reached; rows already
        stored by then are stored again, harmlessly, when the caller retries.
        """
        spec = _TABLE_SPECS[table]
        result = StoreResult()
        rows: list[tuple] = []
        owners: list[list[int]] = []  # items behind each row
        slot: dict[Any, int] = {}
        for i, item in enumerate(items):
            try:
                row = spec.build(item)
                problem = out_of_bounds(table, spec.columns, row)
            except Exception as exc:  # noqa: BLE001 - any failure to build the row is this row's
                problem = f"the sink could not serialise the row: {error_reason(exc)}"
            if problem:
                result.refused.append((i, problem))
                continue
            key = spec.key(row)
            if key in slot:
                owners[slot[key]].append(i)
                if spec.keep_last:
                    rows[slot[key]] = row
                continue
            slot[key] = len(rows)
            rows.append(row)
            owners.append([i])
        refused_rows = self.insert_isolating(table, rows, spec.columns)
        for j, reason in refused_rows:
            result.refused.extend((i, f"ClickHouse refused the row: {reason}") for i in owners[j])
        result.stored = len(rows) - len(refused_rows)
        result.refused.sort()
        return result

    def insert_isolating(self, table: str, rows: Sequence[tuple], columns: Sequence[str]) -> list[tuple[int, str]]:
        """Insert ``rows``; where ClickHouse refuses, split in halves until the refused rows are
        found. Returns (index in ``rows``, reason) of each refused row; all the others are stored.

        On an error, a probe (``SELECT 1``) tells the two cases apart: if ClickHouse answers, the
        data is at fault (a type or range error, a parse error on the server...) and the batch is
        split; if it does not, it is down or unreachable and ``ClickHouseUnavailable`` is raised.
        A single row is declared refused only after a second try, unless the error was raised on
        our side while serialising it (clickhouse-connect's ``DataError`` and the like), which a
        retry cannot change.
        """
        refused: list[tuple[int, str]] = []
        pending = [(0, len(rows))]
        while pending:
            lo, hi = pending.pop()
            error = self._try_insert(table, rows[lo:hi], columns)
            if error is None:
                continue
            self._raise_if_unavailable(error)
            if hi - lo > 1:
                mid = (lo + hi) // 2
                pending.extend(((mid, hi), (lo, mid)))  # the first half first
                continue
            if not isinstance(error, _CLIENT_ROW_ERRORS):
                retry = self._try_insert(table, rows[lo:hi], columns)
                if retry is None:
                    continue
                self._raise_if_unavailable(retry)
                error = retry
            log.warning("runwatch sink: ClickHouse refused a row of %s: %s", table, error_reason(error))
            refused.append((lo, error_reason(error)))
        refused.sort()
        return refused

    def _try_insert(self, table: str, rows: Sequence[tuple], columns: Sequence[str]) -> Exception | None:
        try:
            self._insert(table, list(rows), columns)
        except Exception as exc:  # noqa: BLE001 - classified by the caller
            return exc
        return None

    def reachable(self) -> bool:
        """Whether ClickHouse answers a trivial query (twice tried: the embedded engine can report
        a stale error from the statement before once)."""
        for _ in range(2):
            try:
                self.client.query("SELECT 1")
                return True
            except Exception:  # noqa: BLE001, S112 - any failure means "not now"
                continue
        return False

    def _raise_if_unavailable(self, error: Exception) -> None:
        if isinstance(error, _CLIENT_ROW_ERRORS):
            return  # raised before anything was sent: says nothing about the connection
        if not self.reachable():
            raise ClickHouseUnavailable(f"{type(error).__name__}: {_first_line(str(error))}") from error

    # -- reads ----------------------------------------------------------------------------

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[tuple]:
        return self.client.query(sql.format(db=self.database), parameters=parameters).result_rows

    def run_counts(self, run_id: str) -> dict[str, int]:
        """Rows per table for one run, after deduplication."""
        counts = {}
        for table in ("telemetry", "anomalies", "actions"):
            rows = self.query(f"SELECT count() FROM {{db}}.{table} FINAL WHERE run_id = %(run)s", {"run": run_id})
            counts[table] = int(rows[0][0])
        rows = self.query("SELECT count() FROM {db}.deadletter FINAL WHERE run_key = %(run)s", {"run": run_id})
        counts["deadletter"] = int(rows[0][0])
        return counts

    def run_anomalies(self, run_id: str) -> list[dict[str, Any]]:
        """One run's anomalies (detector, step, severity, rank, message), by step and detector."""
        rows = self.query("SELECT detector, step, severity, rank, message FROM {db}.anomalies FINAL "
                          "WHERE run_id = %(run)s ORDER BY step, detector", {"run": run_id})
        return [{"detector": d, "step": s, "severity": sev, "rank": r, "message": m} for d, s, sev, r, m in rows]

    def run_actions(self, run_id: str) -> list[dict[str, Any]]:
        """One run's actions (kind, step, action_id, reason), in the order they were issued."""
        rows = self.query("SELECT kind, step, action_id, reason FROM {db}.actions FINAL "
                          "WHERE run_id = %(run)s ORDER BY issued_at", {"run": run_id})
        return [{"kind": k, "step": s, "action_id": a, "reason": why} for k, s, a, why in rows]

    # -- run summaries (issue 14: baselines) ----------------------------------------------------

    def write_summaries(self, summaries: Iterable[RunSummary]) -> int:
        """Store run summaries; a run written again replaces its older row (``written_at``)."""
        written_at = datetime.now(UTC)
        rows = list({r[0]: r for r in (summary_row(s, written_at) for s in summaries)}.values())  # the last per run
        return self._insert("run_summaries", rows, SUMMARY_COLUMNS + ("written_at",))

    def _summaries(self, where: str, parameters: dict[str, Any], order: str = "started_at, run_id") -> list[RunSummary]:
        rows = self.query("SELECT " + ", ".join(SUMMARY_COLUMNS) + " FROM {db}.run_summaries FINAL "
                          f"WHERE {where} ORDER BY {order}", parameters)
        return [summary_from_row(r) for r in rows]

    def run_summary(self, run_id: str) -> RunSummary | None:
        """The stored summary of one run, or None."""
        found = self._summaries("run_id = %(r)s", {"r": run_id})
        return found[0] if found else None

    def baseline_candidates(self, baseline_key: str, fingerprint: str, before: datetime,
                            window_days: float) -> list[RunSummary]:
        """The summaries of ``baseline_key`` on ``fingerprint`` that started in the ``window_days``
        before ``before``, oldest first, whatever their status (the declared new baselines among them
        matter too): what ``detectors.baselines.check.select_history`` chooses a history from."""
        since = as_utc(before) - timedelta(days=window_days)
        return self._summaries(
            "baseline_key = %(k)s AND fingerprint = %(f)s AND started_at >= %(since)s AND started_at < %(before)s",
            {"k": baseline_key, "f": fingerprint, "since": since, "before": as_utc(before)})

    def summaries_for_key(self, baseline_key: str, fingerprint: str | None = None) -> list[RunSummary]:
        """Every summary of ``baseline_key`` (on ``fingerprint`` when given), in start order: the
        history a change-point scan runs over."""
        if fingerprint is None:
            return self._summaries("baseline_key = %(k)s", {"k": baseline_key})
        return self._summaries("baseline_key = %(k)s AND fingerprint = %(f)s", {"k": baseline_key, "f": fingerprint})

    def stored_run_events(self, run_id: str) -> list[TelemetryEvent]:
        """The run's stored telemetry decoded from its payloads, in time order: every event of rank 0
        and the step events of the other ranks (what ``RunSummarizer`` uses: rank 0's steps for the
        step figures, every rank's memory maxima; other ranks' heartbeats and acks add nothing to
        it). A payload that no longer decodes is skipped with a warning."""
        from runwatch.producer.wire.schema import SchemaError, decode_event

        rows = self.query("SELECT payload FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND (rank = 0 OR kind = 'step') "
                          "ORDER BY ts, rank, step, event_id", {"r": run_id})
        events = []
        for (payload,) in rows:
            try:
                events.append(decode_event(payload))
            except SchemaError as exc:
                log.warning("runwatch sink: a stored event of run %s does not decode (%s); skipped", run_id, exc.reason)
        return events

    def stored_run_anomalies(self, run_id: str) -> list[Anomaly]:
        """The run's stored anomalies (identity, step, detector, metric, severity, message), by time."""
        rows = self.query("SELECT anomaly_id, run_id, ts, step, rank, detector, metric, severity, message "
                          "FROM {db}.anomalies FINAL WHERE run_id = %(r)s ORDER BY ts, anomaly_id", {"r": run_id})
        return [Anomaly.model_construct(anomaly_id=a, run_id=r, ts=ts, step=step, rank=rank, detector=d, metric=m,
                                        severity=sev, message=msg)
                for a, r, ts, step, rank, d, m, sev, msg in rows]

    def runs_to_summarize(self, now: datetime, died_after_s: float, lookback_s: float = 7 * 86400) -> list[str]:
        """Runs with telemetry whose last event is more than ``died_after_s`` before ``now`` and that
        have no summary, or only one of status ``running``: runs whose events stopped without a
        summary (their heartbeats stopped: they died), oldest last event first. Only runs with an
        event in the ``lookback_s`` before the cutoff are looked at, so the sweep does not read the
        whole telemetry table every time (a run that died longer ago than that while the sink was
        away is summarised by ``runwatch baseline check`` when asked for)."""
        cutoff = as_utc(now) - timedelta(seconds=died_after_s)
        rows = self.query(
            "SELECT run_id, max(ts) AS last FROM {db}.telemetry WHERE ts >= %(since)s GROUP BY run_id "
            "HAVING last < %(cutoff)s "
            "AND run_id NOT IN (SELECT run_id FROM {db}.run_summaries FINAL WHERE status != 'running') "
            "ORDER BY last, run_id", {"cutoff": cutoff, "since": cutoff - timedelta(seconds=lookback_s)})
        return [str(r[0]) for r in rows]

    # -- the remediator's reads ---------------------------------------------------------------

    def remediation_keys(self) -> set[tuple[str, str]]:
        """Every (action_id, target_key) the remediator has recorded, whatever its status."""
        rows = self.query("SELECT DISTINCT action_id, target_key FROM {db}.remediations")
        return {(r[0], r[1]) for r in rows}

    def remediations(self, action_id: str) -> list[dict[str, Any]]:
        """The recorded executions for one action, oldest first, by column name."""
        rows = self.query(
            "SELECT " + ", ".join(REMEDIATION_COLUMNS) + " FROM {db}.remediations FINAL "
            "WHERE action_id = %(a)s ORDER BY started_at", {"a": action_id})
        return [dict(zip(REMEDIATION_COLUMNS, r, strict=True)) for r in rows]

    def run_start_payload(self, run_id: str) -> Any:
        """The stored ``payload`` of the run's newest ``run_start`` event, or None."""
        rows = self.query(
            "SELECT payload FROM {db}.telemetry WHERE run_id = %(r)s AND kind = 'run_start' "
            "ORDER BY ts DESC LIMIT 1", {"r": run_id})
        return rows[0][0] if rows else None

    # -- the per-step baseline band (issue 14: in-flight comparison; detectors/baselines/band.py) --------

    def baseline_band_runs(self, baseline_key: str, fingerprint: str, before: datetime, window_days: float,
                           max_runs: int, exclude_run: str = "") -> list[str]:
        """The runs a band is made of, oldest first: the newest ``max_runs`` of the history the gate
        would choose for a run of ``baseline_key`` on ``fingerprint`` starting at ``before``
        (``check.select_history`` over ``baseline_candidates``)."""
        from runwatch.detectors.baselines.check import select_history
        from runwatch.detectors.baselines.compare import BaselineConfig
        from runwatch.detectors.baselines.summary import RunSummary

        probe = RunSummary(run_id=exclude_run, baseline_key=baseline_key, fingerprint=fingerprint,
                           started_at=as_utc(before))
        candidates = self.baseline_candidates(baseline_key, fingerprint, before, window_days)
        history = select_history(probe, candidates, BaselineConfig(window_days=window_days))
        return [r.run_id for r in history[-max_runs:]] if max_runs > 0 else []

    def baseline_band(self, baseline_key: str, fingerprint: str, before: datetime, window_days: float = 30.0,
                      max_runs: int = 20, *, exclude_run: str = "", bucket_steps: int | None = None,
                      max_buckets: int = 2000,
                      quantiles: tuple[float, float, float] = (0.1, 0.5, 0.9)) -> BaselineBand | None:
        """The per-step band of the baseline runs (``baseline_band_runs``); None without such runs."""
        runs = self.baseline_band_runs(baseline_key, fingerprint, before, window_days, max_runs, exclude_run)
        return self.band_of_runs(runs, baseline_key, fingerprint, bucket_steps=bucket_steps, max_buckets=max_buckets,
                                 quantiles=quantiles)

    def band_of_runs(self, runs: Sequence[str], baseline_key: str, fingerprint: str, *,
                     bucket_steps: int | None = None, max_buckets: int = 2000,
                     quantiles: tuple[float, float, float] = (0.1, 0.5, 0.9)) -> BaselineBand | None:
        """The per-step band of ``runs`` computed from their stored telemetry, as
        ``band.band_from_runs`` computes it from their events; None for no runs. Steps are bucketed
        so that there are at most ``max_buckets`` per metric unless ``bucket_steps`` is given."""
        from runwatch.detectors.baselines.band import BaselineBand, MetricBand, bucket_steps_for

        runs = list(runs)
        if not runs:
            return None
        if bucket_steps is None:
            last = self.query("SELECT max(step) FROM {db}.telemetry FINAL WHERE run_id IN %(runs)s AND rank = 0 "
                              "AND kind IN ('step', 'eval')", {"runs": runs})
            bucket_steps = bucket_steps_for(int(last[0][0] or 0) if last else 0, max_buckets)
        q0, q1, q2 = quantiles
        rows = self.query(_BAND_SQL, {"runs": runs, "b": int(bucket_steps), "q0": q0, "q1": q1, "q2": q2})
        metrics: dict[str, MetricBand] = {}
        for metric, bucket, q, n in rows:
            band = metrics.get(metric)
            if band is None:
                band = metrics[metric] = MetricBand(steps=[], lo=[], mid=[], hi=[], runs=[])
            band.steps.append(int(bucket))
            band.lo.append(float(q[0]))
            band.mid.append(float(q[1]))
            band.hi.append(float(q[2]))
            band.runs.append(int(n))
        return BaselineBand(baseline_key=baseline_key, fingerprint=fingerprint, run_ids=runs, quantiles=quantiles,
                            bucket_steps=bucket_steps, metrics=metrics)


    # -- the run report's reads (issue 15: `runwatch report`, sinks/report/) -------------------------------
    # Each returns plain rows by column name; the report plots them against the step, in time order (a
    # step replayed after a rollback appears once per pass).

    def report_run_info(self, run_id: str) -> dict[str, Any] | None:
        """What is stored of one run: event count, first and last event time, ranks, last step, and the
        newest ``run_start`` and ``run_end`` payloads (JSON text or None); None for an unknown run."""
        rows = self.query("SELECT count(), min(ts), max(ts), uniqExact(rank), max(step) FROM {db}.telemetry FINAL "
                          "WHERE run_id = %(r)s", {"r": run_id})
        if not rows or not rows[0][0]:
            return None
        events, first, last, ranks, last_step = rows[0]
        end = self.query("SELECT payload FROM {db}.telemetry WHERE run_id = %(r)s AND kind = 'run_end' "
                         "ORDER BY ts DESC LIMIT 1", {"r": run_id})
        return {"events": int(events), "first_ts": as_utc(first), "last_ts": as_utc(last), "ranks": int(ranks),
                "last_step": None if last_step is None else int(last_step),
                "run_start": self.run_start_payload(run_id), "run_end": end[0][0] if end else None}

    def report_steps(self, run_id: str, rank: int = 0) -> list[dict[str, Any]]:
        """One rank's step events in time order, each with ``REPORT_STEP_FIELDS`` (None where absent or
        not a finite JSON number), ``lr`` (each param group's) and ``category_loss`` (its raw JSON)."""
        extracted = ", ".join(f"JSONExtract(payload, {path}, 'Nullable(Float64)') AS {name}"
                              for name, path in REPORT_STEP_FIELDS.items())
        columns = ("ts", "step", "loss", "grad_norm", "step_time_s", *REPORT_STEP_FIELDS, "lr", "category_loss")
        rows = self.query(
            f"SELECT ts, step, loss, grad_norm, step_time_s, {extracted}, "
            "JSONExtract(payload, 'lr', 'Array(Nullable(Float64))') AS lr, "
            "JSONExtractRaw(payload, 'category_loss') AS category_loss "
            "FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND rank = %(rank)s AND kind = 'step' "
            "ORDER BY ts, step, event_id", {"r": run_id, "rank": rank})
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def report_rank_step_times(self, run_id: str) -> list[dict[str, Any]]:
        """Every rank's step time and compute time per step event, by rank then time."""
        rows = self.query(
            "SELECT rank, step, ts, step_time_s, JSONExtract(payload, 'compute_s', 'Nullable(Float64)') "
            "FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND kind = 'step' ORDER BY rank, ts, step", {"r": run_id})
        return [{"rank": int(rk), "step": s, "ts": as_utc(ts), "step_time_s": st, "compute_s": c}
                for rk, s, ts, st, c in rows]

    def report_module_grad_norms(self, run_id: str, top: int = 8) -> list[dict[str, Any]]:
        """Rank 0's per-module grad norms of the ``top`` modules with the largest finite norm, in time
        order: rows of (module, step, norm)."""
        rows = self.query(_REPORT_MODULES_SQL, {"r": run_id, "k": int(top)})
        return [{"module": m, "step": int(s), "norm": v} for m, s, v in rows]

    def report_module_heatmap(self, run_id: str, bucket_steps: int, modules: int = 40) -> list[dict[str, Any]]:
        """Rank 0's largest finite grad norm per module and step bucket (``bucket_steps`` steps each), for
        the ``modules`` modules with the largest norm: rows of (module, bucket's first step, norm)."""
        rows = self.query(_REPORT_HEATMAP_SQL, {"r": run_id, "k": int(modules), "b": max(1, int(bucket_steps))})
        return [{"module": m, "step": int(s), "norm": v} for m, s, v in rows]

    def report_evals(self, run_id: str) -> list[dict[str, Any]]:
        """Rank 0's eval events in time order: step, split, loss and the metrics (raw JSON)."""
        rows = self.query(
            "SELECT ts, step, JSONExtractString(payload, 'split'), loss, JSONExtractRaw(payload, 'metrics') "
            "FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND rank = 0 AND kind = 'eval' ORDER BY ts, step",
            {"r": run_id})
        return [{"ts": as_utc(ts), "step": s, "split": sp or "val", "loss": loss, "metrics": m}
                for ts, s, sp, loss, m in rows]

    def report_anomalies(self, run_id: str) -> list[dict[str, Any]]:
        """One run's anomalies with their figures, by step then time."""
        columns = ("ts", "step", "rank", "detector", "metric", "value", "threshold", "score", "severity", "message")
        rows = self.query("SELECT " + ", ".join(columns) + " FROM {db}.anomalies FINAL WHERE run_id = %(r)s "
                          "ORDER BY step, ts, detector", {"r": run_id})
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def report_actions(self, run_id: str) -> list[dict[str, Any]]:
        """One run's actions, in the order they were issued, with what the trainer answered (the newest
        ``action_ack`` of each: outcome, step and rollback target; None when it never answered)."""
        columns = ("action_id", "kind", "reason", "step", "onset_step", "target_step", "issued_at")
        rows = self.query("SELECT " + ", ".join(columns) + " FROM {db}.actions FINAL WHERE run_id = %(r)s "
                          "ORDER BY issued_at", {"r": run_id})
        acks = {a: (o, s, t) for a, o, s, t in self.query(
            "SELECT JSONExtractString(payload, 'action_id') AS a, argMax(JSONExtractString(payload, 'outcome'), ts), "
            "argMax(JSONExtract(payload, 'step', 'Nullable(Int64)'), ts), "
            "argMax(JSONExtract(payload, 'to_step', 'Nullable(Int64)'), ts) "
            "FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND kind = 'action_ack' GROUP BY a", {"r": run_id})}
        out = []
        for row in rows:
            action = dict(zip(columns, row, strict=True))
            outcome, ack_step, to_step = acks.get(action["action_id"], (None, None, None))
            out.append({**action, "outcome": outcome, "ack_step": ack_step, "to_step": to_step})
        return out


def _ms(ts: datetime) -> str:
    """A UTC time as ClickHouse parses it, to the millisecond (DateTime64(3) columns)."""
    return as_utc(ts).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


# Rank 0's per-step values of the baseline runs, one per (run, metric, step) (the newest: a step
# replayed after a rollback counts once), pooled per step bucket into R-7 quantiles
# (quantileExactInclusive), as detectors/baselines/band.py does in Python.
_BAND_SQL = """
SELECT metric, intDiv(step, %(b)s) * %(b)s AS bucket,
       quantilesExactInclusive(%(q0)s, %(q1)s, %(q2)s)(value) AS q, uniqExact(run_id) AS runs
FROM (
    SELECT run_id, metric, step, argMax(v, ts) AS value
    FROM (
        SELECT run_id, ts, assumeNotNull(step) AS step, pair.1 AS metric, pair.2 AS v
        FROM {db}.telemetry FINAL
        ARRAY JOIN arrayConcat(
            [('loss', loss), ('grad_norm', grad_norm), ('step_time_s', step_time_s),
             ('memory_allocated', JSONExtract(payload, 'memory', 'allocated', 'Nullable(Float64)')),
             ('memory_peak', JSONExtract(payload, 'memory', 'peak', 'Nullable(Float64)')),
             ('memory_host_rss', JSONExtract(payload, 'memory', 'host_rss', 'Nullable(Float64)'))],
            arrayMap(kv -> (concat('module_grad_norm/', kv.1), kv.2),
                     JSONExtractKeysAndValues(payload, 'module_grad_norms', 'Nullable(Float64)'))
        ) AS pair
        WHERE run_id IN %(runs)s AND rank = 0 AND kind = 'step' AND step IS NOT NULL
        UNION ALL
        SELECT run_id, ts, assumeNotNull(step) AS step, concat('eval_loss/', JSONExtractString(payload, 'split'))
               AS metric, loss AS v
        FROM {db}.telemetry FINAL
        WHERE run_id IN %(runs)s AND rank = 0 AND kind = 'eval' AND step IS NOT NULL
    )
    WHERE v IS NOT NULL AND isFinite(assumeNotNull(v))
    GROUP BY run_id, metric, step
)
GROUP BY metric, bucket
ORDER BY metric, bucket
"""


# -- the run report's SQL (issue 15) ----------------------------------------------------------------------

# What ``report_steps`` takes from a step payload beyond the typed columns: name -> JSONExtract path.
REPORT_STEP_FIELDS: dict[str, str] = {
    "grad_norm_clipped": "'grad_norm_clipped'", "clip_ratio": "'clip_ratio'", "param_norm": "'param_norm'",
    "update_norm": "'update_norm'", "relative_update_norm": "'relative_update_norm'",
    "effective_lr_ratio": "'effective_lr_ratio'", "data_wait_s": "'data_wait_s'", "compute_s": "'compute_s'",
    "samples_per_s": "'samples_per_s'", "tokens_per_s": "'tokens_per_s'", "mfu": "'mfu'",
    "nonfinite_grads": "'nonfinite_grads'",
    "memory_allocated": "'memory', 'allocated'", "memory_reserved": "'memory', 'reserved'",
    "memory_peak": "'memory', 'peak'", "memory_host_rss": "'memory', 'host_rss'",
}

# Rank 0's module norms, one (module, step, norm) per step event; the modules with the largest finite norm.
_REPORT_MODULE_NORMS = """
    SELECT ts, assumeNotNull(step) AS step, kv.1 AS module, kv.2 AS norm
    FROM {db}.telemetry FINAL
    ARRAY JOIN JSONExtractKeysAndValues(payload, 'module_grad_norms', 'Nullable(Float64)') AS kv
    WHERE run_id = %(r)s AND rank = 0 AND kind = 'step' AND step IS NOT NULL
"""
_REPORT_TOP_MODULES = f"""
    SELECT module FROM ({_REPORT_MODULE_NORMS}) WHERE norm IS NOT NULL AND isFinite(assumeNotNull(norm))
    GROUP BY module ORDER BY max(norm) DESC, module LIMIT %(k)s
"""
_REPORT_MODULES_SQL = f"""
SELECT module, step, norm FROM ({_REPORT_MODULE_NORMS})
WHERE module IN ({_REPORT_TOP_MODULES})
ORDER BY module, ts, step
"""
_REPORT_HEATMAP_SQL = f"""
SELECT module, intDiv(step, %(b)s) * %(b)s AS bucket, max(norm)
FROM ({_REPORT_MODULE_NORMS})
WHERE module IN ({_REPORT_TOP_MODULES}) AND norm IS NOT NULL AND isFinite(assumeNotNull(norm))
GROUP BY module, bucket
ORDER BY module, bucket
"""
