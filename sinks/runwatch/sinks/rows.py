"""The sink's rows, pure: each table's columns and integer bounds, and how a wire object becomes a row
(each builder may raise: a value that cannot be serialised is a fault of that row alone); why a row
cannot be stored (``out_of_bounds``, ``storable_time``) and a refused row's one-line reason."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import orjson

from runwatch.contract.schema import Action, Anomaly, DeadLetter, JoinedStep, TelemetryEvent

if TYPE_CHECKING:
    from runwatch.detectors.baselines.summary import RunSummary

Row: TypeAlias = tuple[Any, ...]  # one row of a table, its values in the table's column order

TELEMETRY_COLUMNS = (
    "event_id",
    "run_id",
    "rank",
    "kind",
    "ts",
    "step",
    "loss",
    "grad_norm",
    "step_time_s",
    "payload",
)
ANOMALY_COLUMNS = (
    "anomaly_id",
    "run_id",
    "ts",
    "step",
    "onset_step",
    "rank",
    "detector",
    "metric",
    "value",
    "threshold",
    "score",
    "severity",
    "message",
    "evidence",
    "detected_at",
)
ACTION_COLUMNS = (
    "action_id",
    "run_id",
    "kind",
    "reason",
    "anomaly_ids",
    "step",
    "onset_step",
    "target_step",
    "target_uri",
    "params",
    "issued_at",
    "expires_at",
)
DEADLETTER_COLUMNS = (
    "id",
    "ts",
    "source_topic",
    "partition",
    "offset",
    "run_key",
    "reason",
    "stage",
    "size",
    "sha256",
    "raw",
    "raw_truncated",
    "traceback",
)
JOINED_COLUMNS = tuple(name for name in JoinedStep.model_fields if name != "schema_version")
REMEDIATION_COLUMNS = (
    "execution_id",
    "action_id",
    "run_id",
    "kind",
    "target",
    "target_key",
    "argv",
    "url",
    "status",
    "exit_code",
    "output",
    "started_at",
    "finished_at",
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
# tests/sinks/test_sink_poison.py checks this table against the migrated schema.
COLUMN_BOUNDS: dict[str, dict[str, IntRange]] = {
    "telemetry": {"rank": UINT32, "step": INT64},
    "anomalies": {"step": INT64, "onset_step": INT64, "rank": UINT32},
    "actions": {"step": INT64, "onset_step": INT64, "target_step": INT64},
    "deadletter": {"partition": INT32, "offset": INT64, "size": UINT64},
    "joined_steps": {
        "step": INT64,
        "generation": UINT32,
        "world_size": UINT32,
        "ranks_reported": UINT32,
        "ranks_missing": UINT32,
        "reported_count": UINT32,
        "missing_count": UINT32,
        "step_time_max_rank": UINT32,
        "compute_max_rank": UINT32,
        "memory_max_bytes": INT64,
        "memory_max_rank": UINT32,
        "memory_min_bytes": INT64,
        "memory_min_rank": UINT32,
        "late_events": UINT64,
        "duplicate_events": UINT64,
    },
}

REASON_MAX_CHARS = 500  # of ClickHouse's error message in a dead letter's reason


# Tables whose rows expire by their ``ts`` (``TTL toDateTime(ts) + INTERVAL n DAY`` in
# sinks/runwatch/sinks/migrations.py)
RETENTION_DAYS = {"telemetry": 90, "joined_steps": 90, "deadletter": 30}
# toDateTime in those TTLs is 32-bit seconds: a later ts would be stored as another time
LAST_STORABLE_TS = datetime(2106, 2, 7, tzinfo=UTC)


def storable_time(table: str, ts: datetime, now: datetime) -> str | None:
    """Why a row of ``table`` dated ``ts`` would not be kept as sent (None: it would): older than the
    table's retention (ClickHouse would delete it at once), or past what its TTL can represent."""
    days = RETENTION_DAYS.get(table)
    if days is not None and ts < now - timedelta(days=days):
        return (
            f"ts: {ts.isoformat()} is older than the {table} table's {days}-day retention: it would be "
            "deleted as soon as stored"
        )
    if ts >= LAST_STORABLE_TS:
        return (
            f"ts: {ts.isoformat()} is past {LAST_STORABLE_TS.date()}, "
            f"the last time the {table} table can hold"
        )
    return None


def as_utc(ts: datetime) -> datetime:
    """``ts`` with UTC as its zone if it has none (ClickHouse's DateTime64 columns are UTC)."""
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def unique_rows(rows: Iterable[Row], key_index: int = 0) -> list[Row]:
    seen: dict[Any, Row] = {}
    for row in rows:
        seen.setdefault(row[key_index], row)
    return list(seen.values())


def _text(raw: bytes | bytearray | memoryview | str) -> str:
    if isinstance(raw, str):
        return raw
    return bytes(raw).decode("utf-8", errors="replace")


def first_line(text: str, limit: int = REASON_MAX_CHARS) -> str:
    line = next((part.strip() for part in str(text).splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def error_reason(exc: BaseException) -> str:
    """A one-line reason for a refused row: the error's type and the first line of its message
    (clickhouse-connect's client-side ``DataError`` says which column; its cause says why)."""
    message = first_line(str(exc))
    reason = f"{type(exc).__name__}: {message}"
    cause = exc.__cause__
    detail = first_line(str(cause), 200) if cause is not None else ""
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
                return (
                    f"{table}.{name}: {type(v).__name__} {first_line(repr(v), 100)} in a {bound.type} column"
                )
            if not bound.min <= v <= bound.max:
                shown = str(v) if v.bit_length() <= 256 else f"an integer of {v.bit_length()} bits"
                return f"{table}.{name}: {shown} is out of range for {bound.type} [{bound.min}, {bound.max}]"
    return None


# -- rows ----------------------------------------------------------------------------------------


def event_row(e: TelemetryEvent, raw: bytes | str | None = None) -> Row:
    """The telemetry row of ``e``; ``payload`` is ``raw`` (the bytes received, as UTF-8 text) when
    given, else ``e`` re-serialised (for events made in process, never received, and for an evidence event
    truncated to its bounds: what is stored is what the worker judged, never more)."""
    if raw is not None and e.kind in ("evidence", "crash") and e.truncated:
        raw = None
    payload = _text(raw) if raw is not None else e.to_json().decode()
    return (
        e.event_id,
        e.run_id,
        e.rank,
        e.kind,
        as_utc(e.ts),
        getattr(e, "step", None),
        getattr(e, "loss", None),
        getattr(e, "grad_norm", None),
        getattr(e, "step_time_s", None),
        payload,
    )


def anomaly_row(a: Anomaly) -> Row:
    return (
        a.anomaly_id,
        a.run_id,
        as_utc(a.ts),
        a.step,
        a.onset_step,
        a.rank,
        a.detector,
        a.metric,
        a.value,
        a.threshold,
        a.score,
        a.severity,
        a.message,
        orjson.dumps(a.evidence, default=str).decode(),
        as_utc(a.detected_at) if a.detected_at is not None else None,
    )


def action_row(a: Action) -> Row:
    target = a.target_checkpoint
    return (
        a.action_id,
        a.run_id,
        a.kind,
        a.reason,
        list(a.anomaly_ids),
        a.step,
        a.onset_step,
        target.step if target else None,
        target.uri if target else None,
        orjson.dumps(a.params, default=str).decode(),
        as_utc(a.issued_at),
        as_utc(a.expires_at),
    )


def deadletter_id(d: DeadLetter) -> str:
    """Stable per message and stage, so that a re-delivered dead letter replaces its earlier copy.
    (Letters of stage ``decode`` keep the id they had before stages existed.)"""
    ident = f"{d.source_topic}|{d.partition}|{d.offset}|{d.raw}"
    if d.stage != "decode":
        ident += f"|{d.stage}"
    return hashlib.sha1(ident.encode(errors="replace")).hexdigest()


def deadletter_row(d: DeadLetter) -> Row:
    return (
        deadletter_id(d),
        as_utc(d.ts),
        d.source_topic,
        d.partition,
        d.offset,
        d.key,
        d.reason,
        d.stage,
        d.size,
        d.sha256,
        d.raw,
        d.raw_truncated,
        d.traceback,
    )


def joined_row(j: JoinedStep) -> Row:
    return tuple(as_utc(j.ts) if c == "ts" else getattr(j, c) for c in JOINED_COLUMNS)


def joined_key(row: Row) -> Row:
    return (row[0], row[2], row[1])  # (run_id, generation, step)


SUMMARY_COLUMNS = (
    "run_id",
    "baseline_key",
    "git_sha",
    "git_dirty",
    "commit_time",
    "fingerprint",
    "fingerprint_parts",
    "config_hash",
    "dataset_version",
    "new_baseline",
    "started_at",
    "ended_at",
    "status",
    "metrics",
)
# started_at of a summary that has none (the column is not nullable)
NO_TIME = datetime(1970, 1, 1, tzinfo=UTC)


def summary_row(s: RunSummary, written_at: datetime) -> Row:
    """The ``run_summaries`` row of ``s``: absent text is '' (the columns are not nullable), a
    missing figure an absent key of ``metrics``."""
    return (
        s.run_id,
        s.baseline_key or "",
        s.git_sha or "",
        s.git_dirty,
        as_utc(s.commit_time) if s.commit_time is not None else None,
        s.fingerprint,
        dict(s.fingerprint_parts),
        s.config_hash or "",
        s.dataset_version or "",
        s.new_baseline,
        as_utc(s.started_at) if s.started_at is not None else NO_TIME,
        as_utc(s.ended_at) if s.ended_at is not None else None,
        s.status,
        {k: float(v) for k, v in s.metrics.items() if v is not None},
        written_at,
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
