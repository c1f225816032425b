"""``ClickHouseSink``: writes telemetry, anomalies, actions and dead letters.

One code path for the embedded engine (``chdb:///path``) and a server
(``http(s)://user:pass@host:8123``): clickhouse-connect picks the transport from the DSN.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from runwatch.producer.schema import Action, Anomaly, DeadLetter, EventBase, JoinedStep
from runwatch.sinks.migrations import MIGRATIONS

DEFAULT_DSN_PATH = Path(".runwatch") / "clickhouse"
TABLES = ("telemetry", "anomalies", "actions", "deadletter", "joined_steps")

TELEMETRY_COLUMNS = (
    "event_id", "run_id", "rank", "kind", "ts", "step", "loss", "grad_norm", "step_time_s", "payload",
)
ANOMALY_COLUMNS = (
    "anomaly_id", "run_id", "ts", "step", "rank", "detector", "metric", "value", "threshold", "score",
    "severity", "message", "evidence",
)
ACTION_COLUMNS = (
    "action_id", "run_id", "kind", "reason", "anomaly_ids", "step", "onset_step", "target_step", "target_uri",
    "params", "issued_at", "expires_at",
)
DEADLETTER_COLUMNS = ("id", "ts", "source_topic", "partition", "offset", "run_key", "reason", "raw")
JOINED_COLUMNS = tuple(name for name in JoinedStep.model_fields if name != "schema_version")


def default_dsn() -> str:
    return f"chdb://{DEFAULT_DSN_PATH.resolve()}"


def _utc(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def _unique(rows: Iterable[tuple], key_index: int = 0) -> list[tuple]:
    seen: dict[Any, tuple] = {}
    for row in rows:
        seen.setdefault(row[key_index], row)
    return list(seen.values())


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

    def write_events(self, events: Iterable[EventBase]) -> int:
        rows = []
        for e in events:
            rows.append((
                e.event_id, e.run_id, e.rank, e.kind, _utc(e.ts),
                getattr(e, "step", None), getattr(e, "loss", None), getattr(e, "grad_norm", None),
                getattr(e, "step_time_s", None), e.to_json().decode(),
            ))
        return self._insert("telemetry", _unique(rows), TELEMETRY_COLUMNS)

    def write_anomalies(self, anomalies: Iterable[Anomaly]) -> int:
        rows = [
            (a.anomaly_id, a.run_id, _utc(a.ts), a.step, a.rank, a.detector, a.metric, a.value, a.threshold,
             a.score, a.severity, a.message, orjson.dumps(a.evidence, default=str).decode())
            for a in anomalies
        ]
        return self._insert("anomalies", _unique(rows), ANOMALY_COLUMNS)

    def write_actions(self, actions: Iterable[Action]) -> int:
        rows = []
        for a in actions:
            target = a.target_checkpoint
            rows.append((
                a.action_id, a.run_id, a.kind, a.reason, list(a.anomaly_ids), a.step, a.onset_step,
                target.step if target else None, target.uri if target else None,
                orjson.dumps(a.params, default=str).decode(), _utc(a.issued_at), _utc(a.expires_at),
            ))
        return self._insert("actions", _unique(rows), ACTION_COLUMNS)

    def write_deadletters(self, letters: Iterable[DeadLetter]) -> int:
        rows = []
        for d in letters:
            ident = hashlib.sha1(f"{d.source_topic}|{d.partition}|{d.offset}|{d.raw}".encode()).hexdigest()
            rows.append((ident, _utc(d.ts), d.source_topic, d.partition, d.offset, d.key, d.reason, d.raw))
        return self._insert("deadletter", _unique(rows), DEADLETTER_COLUMNS)

    def write_joined(self, joined: Iterable[JoinedStep]) -> int:
        rows = [tuple(_utc(j.ts) if c == "ts" else getattr(j, c) for c in JOINED_COLUMNS) for j in joined]
        rows = list({(r[0], r[2], r[1]): r for r in rows}.values())  # (run_id, generation, step): the newest
        return self._insert("joined_steps", rows, JOINED_COLUMNS)

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
