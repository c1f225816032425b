"""``runwatch migrate``: create or upgrade the ClickHouse schema once, before the sink, the workers and the
remediator start (deploy/compose.yaml runs it as a one-shot step)."""

from __future__ import annotations

import time

import click

from runwatch.cli.failure import CommandError
from runwatch.cli.needs import NeedsExtra, require_engine


@click.command(cls=NeedsExtra, extras=["sink"])
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help="chdb:///path or http(s)://user:pass@host:8123")
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="seconds to keep retrying while the server does not answer (it may still be starting)",
)
def migrate(dsn: str | None, wait_s: float) -> None:
    """Apply the ClickHouse migrations not applied yet (sinks/runwatch/sinks/migrations.py) and
    print the schema version.

    The sink and the remediator also migrate when they start; running this first means they find the
    tables there and never race each other to create them."""
    from clickhouse_connect.driver.exceptions import OperationalError

    from runwatch.cli.startup import check_dsn
    from runwatch.contract.logsafe import redacted
    from runwatch.sinks import ClickHouseSink, default_dsn

    check_dsn(dsn or default_dsn(), create=True, default=dsn is None)
    dsn = dsn or default_dsn()
    require_engine("runwatch migrate", dsn)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            store = ClickHouseSink(dsn)
            break
        except OperationalError as exc:  # connection refused / not up yet; bad credentials are not retried
            if time.monotonic() >= deadline:
                why = str(exc).replace(dsn, redacted(dsn)).splitlines()[0][:300] if str(exc) else ""
                raise CommandError(
                    f"ClickHouse at {redacted(dsn)} did not answer within {wait_s:g} s: {why}"
                ) from None
            time.sleep(1.0)
        except Exception as exc:  # noqa: BLE001 - bad credentials, a refused database: one line
            why = str(exc).replace(dsn, redacted(dsn)).splitlines()[0][:300] if str(exc) else ""
            raise CommandError(
                f"cannot open ClickHouse at {redacted(dsn)}: {type(exc).__name__}: {why}"
            ) from None
    try:
        applied = store.migrate()
        click.echo(
            f"ClickHouse {redacted(store.dsn)}: schema v{store.schema_version()} "
            f"(applied now: {applied or 'none'})"
        )
    finally:
        store.close()
