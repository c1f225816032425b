"""What the ClickHouse-reading commands (``ingest``, ``baseline``) share: exit 2 with a message on an
error, and opening the sink with a clear error when ClickHouse cannot be reached."""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import click

from runwatch.cli.needs import current_command, require_engine

if TYPE_CHECKING:
    from runwatch.sinks.clickhouse import ClickHouseSink

EXIT_ERROR = 2
DSN_HELP = "chdb:///path or http(s)://user:pass@host:8123 (default: the sink's, chdb://.runwatch/clickhouse)"


def fail(message: str) -> NoReturn:
    """Print ``error: message`` to stderr and exit 2 (a gate's "could not judge", never 0 or 1)."""
    click.echo(f"error: {message}", err=True)
    raise SystemExit(EXIT_ERROR)


def open_sink(dsn: str | None) -> ClickHouseSink:
    """The ClickHouse sink at ``dsn`` (default: the sink's), migrated; exits 2 saying why when it
    cannot be opened or reached."""
    from runwatch.sinks.clickhouse import ClickHouseSink, default_dsn

    dsn = dsn or default_dsn()
    require_engine(current_command(), dsn)
    try:
        sink = ClickHouseSink(dsn)
    except Exception as exc:  # noqa: BLE001 - a bad DSN or an unreachable server, said plainly
        fail(f"cannot open ClickHouse at {dsn}: {type(exc).__name__}: {exc}")
    try:
        sink.migrate()
    except Exception as exc:  # noqa: BLE001
        sink.close()
        fail(f"ClickHouse at {dsn} does not answer: {type(exc).__name__}: {exc}")
    return sink
