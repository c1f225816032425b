"""``ClickHouseSink``: the connection to ClickHouse and its schema, with the sink's parts on it: ``writer``
(sinks/runwatch/sinks/writer.py), ``runs`` (sinks/runwatch/sinks/run_reads.py), ``baselines``
(sinks/runwatch/sinks/baseline_reads.py) and ``report`` (sinks/runwatch/sinks/report/queries.py), each of
which takes it as a ``Connection`` (sinks/runwatch/sinks/connection.py, a leaf: the parts never import this
module). The rows themselves are sinks/runwatch/sinks/rows.py's.

One code path for the embedded engine (``chdb:///path``) and a server
(``http(s)://user:pass@host:8123``): clickhouse-connect picks the transport from the DSN.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from runwatch.sinks.migrations import MIGRATIONS

if TYPE_CHECKING:
    from runwatch.sinks.baseline_reads import BaselineReads
    from runwatch.sinks.report.queries import ReportReads
    from runwatch.sinks.run_reads import RunReads
    from runwatch.sinks.writer import SinkWriter

DEFAULT_DSN_PATH = Path(".runwatch") / "clickhouse"
TABLES = ("telemetry", "anomalies", "actions", "deadletter", "joined_steps", "run_summaries")


def default_dsn() -> str:
    return f"chdb://{DEFAULT_DSN_PATH.resolve()}"


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
        # One statement at a time: the local page (sinks/page/) reads from its own threads while the sink
        # consumer writes, and an embedded engine's session is not safe to share between them.
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self.client.close()

    # -- the parts: writes and read models ---------------------------------------------------

    @cached_property
    def writer(self) -> SinkWriter:
        from runwatch.sinks.writer import SinkWriter

        return SinkWriter(self)

    @cached_property
    def runs(self) -> RunReads:
        from runwatch.sinks.run_reads import RunReads

        return RunReads(self)

    @cached_property
    def baselines(self) -> BaselineReads:
        from runwatch.sinks.baseline_reads import BaselineReads

        return BaselineReads(self)

    @cached_property
    def report(self) -> ReportReads:
        from runwatch.sinks.report.queries import ReportReads

        return ReportReads(self)

    # -- schema -----------------------------------------------------------------------

    def migrate(self) -> list[int]:
        """Apply every migration not yet recorded; returns the versions applied now."""
        with self._lock:
            return self._migrate()

    def _migrate(self) -> list[int]:
        db = self.database
        self.client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
        self.client.command(
            f"CREATE TABLE IF NOT EXISTS {db}.schema_migrations "
            "(version UInt32, name String, applied_at DateTime64(3, 'UTC')) "
            "ENGINE = ReplacingMergeTree ORDER BY version"
        )
        done = {
            row[0] for row in self.client.query(f"SELECT version FROM {db}.schema_migrations").result_rows
        }
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
        rows = self.query("SELECT max(version) FROM {db}.schema_migrations")
        return int(rows[0][0]) if rows else 0

    # -- the connection ------------------------------------------------------------------

    def insert(self, table: str, rows: list[tuple[Any, ...]], columns: Sequence[str]) -> int:
        """Insert ``rows`` into ``table`` of the sink's database; returns how many."""
        if rows:
            with self._lock:
                self.client.insert(f"{self.database}.{table}", rows, column_names=list(columns))
        return len(rows)

    def query(self, sql: str, parameters: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Rows of ``sql``, whose ``{db}`` is the sink's database."""
        with self._lock:
            rows = self.client.query(sql.format(db=self.database), parameters=parameters).result_rows
        return cast("list[tuple[Any, ...]]", rows)  # a list of tuples (typed as sequences)

    def reachable(self) -> bool:
        """Whether ClickHouse answers a trivial query (twice tried: the embedded engine can report
        a stale error from the statement before once)."""
        for _ in range(2):
            try:
                with self._lock:
                    self.client.query("SELECT 1")
                return True
            except Exception:  # noqa: BLE001 - any failure means "not now"
                continue
        return False
