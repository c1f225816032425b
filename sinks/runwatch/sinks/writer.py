"""``SinkWriter``: the sink's writes, each idempotent on its row's id (the tables deduplicate on it).

``store`` is what the sink consumer uses: it never lets one row hold up the others. A row that cannot
be built (a value out of its column's range, a field that cannot be serialised) or that ClickHouse
refuses is reported back with the reason, having stored all the others (a refused batch is split in
halves until the offending rows are found). Only when ClickHouse cannot be reached at all does it
raise ``ClickHouseUnavailable``: then nothing can be concluded about the rows, and the caller retries
the whole batch later.
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from runwatch.contract.schema import Action, Anomaly, DeadLetter, JoinedStep, TelemetryEvent
from runwatch.sinks.connection import ClickHouseUnavailable, Connection
from runwatch.sinks.rows import (
    ACTION_COLUMNS,
    ANOMALY_COLUMNS,
    DEADLETTER_COLUMNS,
    JOINED_COLUMNS,
    REMEDIATION_COLUMNS,
    SUMMARY_COLUMNS,
    TELEMETRY_COLUMNS,
    Row,
    action_row,
    anomaly_row,
    as_utc,
    deadletter_row,
    error_reason,
    event_row,
    first_line,
    joined_key,
    joined_row,
    out_of_bounds,
    summary_row,
    unique_rows,
)

if TYPE_CHECKING:
    from runwatch.detectors.baselines.summary import RunSummary

log = logging.getLogger(__name__)


@dataclass
class StoreResult:
    """What ``SinkWriter.store`` did: rows stored, and the items refused as (index, reason)."""

    stored: int = 0
    refused: list[tuple[int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class _Table:
    columns: tuple[str, ...]
    build: Callable[[Any], Row]
    key: Callable[[Row], Any]
    keep_last: bool = False  # of rows with one key in a batch, store the last (else the first)


_TABLE_SPECS: dict[str, _Table] = {
    "telemetry": _Table(TELEMETRY_COLUMNS, lambda item: event_row(*item), lambda r: r[0]),
    "anomalies": _Table(ANOMALY_COLUMNS, anomaly_row, lambda r: r[0]),
    "actions": _Table(ACTION_COLUMNS, action_row, lambda r: r[0]),
    "deadletter": _Table(DEADLETTER_COLUMNS, deadletter_row, lambda r: r[0]),
    "joined_steps": _Table(JOINED_COLUMNS, joined_row, joined_key, keep_last=True),
}

# Errors raised on our side while serialising rows for an insert: the data is at fault, never the
# connection (clickhouse-connect raises DataError for a value its column type cannot hold).
_CLIENT_ROW_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    OverflowError,
    struct.error,
    RecursionError,
)
try:
    from clickhouse_connect.driver.exceptions import DataError as _DataError

    _CLIENT_ROW_ERRORS += (_DataError,)
except ImportError:  # pragma: no cover - clickhouse-connect is a dependency
    pass


# ClickHouse error codes that concern the store, never one row (src/Common/ErrorCodes.cpp): an insert that
# hits one is retried whole, later, and no row is refused for it.
STORE_ERROR_CODES = {
    60: "UNKNOWN_TABLE",
    81: "UNKNOWN_DATABASE",
    159: "TIMEOUT_EXCEEDED",
    164: "READONLY",
    201: "QUOTA_EXCEEDED",
    202: "TOO_MANY_SIMULTANEOUS_QUERIES",
    209: "SOCKET_TIMEOUT",
    210: "NETWORK_ERROR",
    236: "ABORTED",
    241: "MEMORY_LIMIT_EXCEEDED",
    242: "TABLE_IS_READ_ONLY",
    243: "NOT_ENOUGH_SPACE",
    252: "TOO_MANY_PARTS",
    285: "TOO_FEW_LIVE_REPLICAS",
    319: "UNKNOWN_STATUS_OF_INSERT",
    425: "SYSTEM_ERROR",
    497: "ACCESS_DENIED",
    516: "AUTHENTICATION_FAILED",
}
_ERROR_CODE = re.compile(r"\bCode: (\d+)\b")


def error_code(error: BaseException) -> int | None:
    """The ClickHouse error code an exception carries, if any."""
    m = _ERROR_CODE.search(str(error))
    return int(m.group(1)) if m else None


def is_store_error(error: BaseException) -> bool:
    return error_code(error) in STORE_ERROR_CODES


class SinkWriter:
    """Writes to ``sink``'s tables (``sink.writer``)."""

    def __init__(self, sink: Connection):
        self.sink = sink

    def _insert(self, table: str, rows: list[Row], columns: Sequence[str]) -> int:
        return self.sink.insert(table, rows, columns)

    def write_events(
        self, events: Iterable[TelemetryEvent], raws: Iterable[bytes | str | None] | None = None
    ) -> int:
        """Store telemetry events; ``raws`` (parallel to ``events``) are the bytes each was received
        as, stored as its ``payload``. Without them (events made in process) the payload is the
        event re-serialised."""
        events = list(events)
        raw_list = list(raws) if raws is not None else [None] * len(events)
        if len(raw_list) != len(events):
            raise ValueError(f"{len(events)} events but {len(raw_list)} raw values")
        rows = [event_row(e, raw) for e, raw in zip(events, raw_list, strict=True)]
        return self._insert("telemetry", unique_rows(rows), TELEMETRY_COLUMNS)

    def write_anomalies(self, anomalies: Iterable[Anomaly]) -> int:
        return self._insert("anomalies", unique_rows(anomaly_row(a) for a in anomalies), ANOMALY_COLUMNS)

    def write_actions(self, actions: Iterable[Action]) -> int:
        return self._insert("actions", unique_rows(action_row(a) for a in actions), ACTION_COLUMNS)

    def write_deadletters(self, letters: Iterable[DeadLetter]) -> int:
        return self._insert("deadletter", unique_rows(deadletter_row(d) for d in letters), DEADLETTER_COLUMNS)

    def write_joined(self, joined: Iterable[JoinedStep]) -> int:
        rows = list({joined_key(r): r for r in (joined_row(j) for j in joined)}.values())  # the newest
        return self._insert("joined_steps", rows, JOINED_COLUMNS)

    def write_remediation(self, row: Sequence[Any]) -> None:
        """One command run or webhook post of the remediator, in ``REMEDIATION_COLUMNS`` order."""
        row = tuple(
            as_utc(v) if c in ("started_at", "finished_at") else v
            for c, v in zip(REMEDIATION_COLUMNS, row, strict=True)
        )
        self._insert("remediations", [row], REMEDIATION_COLUMNS)

    # -- writes that isolate refused rows (the sink consumer's) ---------------------------------

    def store(self, table: str, items: Sequence[Any]) -> StoreResult:
        """Store ``items`` in ``table`` and report those that cannot be stored, never blocking the rest.

        ``items`` are what the ``write_*`` method of the table takes; for ``telemetry``,
        ``(event, raw)`` pairs (``raw``: the bytes received). An item is refused, with a one-line
        reason, when its row cannot be built (a value cannot be serialised, an integer is outside
        its column's range: ``COLUMN_BOUNDS``) or ClickHouse refuses it (found by splitting the
        batch). Items with the same key share one row (the tables deduplicate on it anyway) and its
        verdict. Raises ``runwatch.sinks.connection.ClickHouseUnavailable`` if ClickHouse cannot be reached;
        rows already stored by then are stored again, harmlessly, when the caller retries.
        """
        spec = _TABLE_SPECS[table]
        result = StoreResult()
        rows: list[Row] = []
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

    def insert_isolating(
        self, table: str, rows: Sequence[Row], columns: Sequence[str]
    ) -> list[tuple[int, str]]:
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
        codes: set[int | None] = set()  # the server's error codes of the refused rows
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
            refused.append((lo, error_reason(error)))
            codes.add(None if isinstance(error, _CLIENT_ROW_ERRORS) else error_code(error))
        if len(rows) > 1 and len(refused) == len(rows) and len(codes) == 1 and None not in codes:
            # one server error that every single row hits is the store's, not theirs
            raise ClickHouseUnavailable(f"every row of {table} refused: {refused[0][1]}")
        for _, reason in refused:
            log.warning("runwatch sink: ClickHouse refused a row of %s: %s", table, reason)
        refused.sort()
        return refused

    def _try_insert(self, table: str, rows: Sequence[Row], columns: Sequence[str]) -> Exception | None:
        try:
            self._insert(table, list(rows), columns)
        except Exception as exc:  # noqa: BLE001 - classified by the caller
            return exc
        return None

    def write_summaries(self, summaries: Iterable[RunSummary]) -> int:
        """Store run summaries; a run written again replaces its older row (``written_at``)."""
        written_at = datetime.now(UTC)
        # the last per run
        rows = list({r[0]: r for r in (summary_row(s, written_at) for s in summaries)}.values())
        return self._insert("run_summaries", rows, SUMMARY_COLUMNS + ("written_at",))

    def _raise_if_unavailable(self, error: Exception) -> None:
        if isinstance(error, _CLIENT_ROW_ERRORS):
            return  # raised before anything was sent: says nothing about the connection
        if is_store_error(error) or not self.sink.reachable():
            raise ClickHouseUnavailable(f"{type(error).__name__}: {first_line(str(error))}") from error
