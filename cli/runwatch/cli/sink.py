"""``runwatch sink``: telemetry, anomalies, actions and dead letters into ClickHouse."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from runwatch.cli.failure import CommandError
from runwatch.cli.needs import NeedsExtra
from runwatch.cli.options import BOOTSTRAP_HELP, cli_config, ready_file_option
from runwatch.cli.repeats import quiet_repeats
from runwatch.cli.signals import run_until_signalled
from runwatch.contract import topics


@click.command(cls=NeedsExtra, extras=["sink"])
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, required=True, help=BOOTSTRAP_HELP)
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help="chdb:///path or http(s)://user:pass@host:8123")
@click.option("--batch-size", type=int, default=2000, show_default=True)
@click.option("--batch-interval", type=float, default=1.0, show_default=True, help="seconds")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="the workers' YAML: its `limits:` decide which telemetry is stored (the same as the workers'), "
    "its `baseline.loss_every` the run summaries' loss_at_step_N",
)
@click.option(
    "--died-after",
    type=click.FloatRange(min=1),
    default=600.0,
    show_default=True,
    help="seconds without an event after which a run with no run_end is summarised as died",
)
@click.option(
    "--page-port",
    type=int,
    help="also serve the local page (the runs and their reports) on this port; 0 picks a free one",
)
@click.option("--page-host", default="127.0.0.1", show_default=True, help="where the local page listens")
@ready_file_option
def sink(
    bootstrap: str,
    dsn: str | None,
    batch_size: int,
    batch_interval: float,
    config_path: str | None,
    died_after: float,
    page_port: int | None,
    page_host: str,
    ready_file: Path | None,
) -> None:
    """Store telemetry, anomalies, actions and dead letters in ClickHouse (group runwatch-sink), and
    write each run's summary (run_summaries) when it ends or dies."""
    from runwatch.cli.startup import open_store, require_topics
    from runwatch.contract.logsafe import redacted
    from runwatch.contract.signing import MissingKeyError, resolve_public_keys
    from runwatch.sinks import SinkConsumer

    config = cli_config(config_path)
    limits = config.limits
    try:
        public_keys = resolve_public_keys()  # actions are stored only when signed by the workers' key
    except MissingKeyError as exc:
        raise CommandError(str(exc)) from None
    store = open_store(dsn)
    try:
        partitions = require_topics(bootstrap, topics.ALL_TOPICS)[topics.TELEMETRY]
    except CommandError:
        store.close()
        raise
    # (after the startup checks: what a client library logs while it retries is not the one line)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # its connection chatter: about 80 lines a start
    quiet_repeats("kafka")  # and a broker gone away: one line per kind every 30 s, not 10 a second
    click.echo(f"ClickHouse {redacted(store.dsn)}: schema v{store.schema_version()}")
    consumer = SinkConsumer(
        store,
        bootstrap,
        batch_size=batch_size,
        batch_interval_s=batch_interval,
        limits=limits,
        died_after_s=died_after,
        summary_loss_every=config.baseline.loss_every,
        public_keys=public_keys,
        partitions=partitions,
    )
    page = None
    if page_port is not None:
        from runwatch.sinks.page import PageServer

        try:
            page = PageServer(store, page_host, page_port, config.baseline).start()
        except OSError as exc:
            store.close()
            raise CommandError(f"the page cannot listen on {page_host}:{page_port}: {exc.strerror}") from None
        click.echo(f"page {page.url}")
    try:
        run_until_signalled(consumer, store, ready_file)
    finally:
        if page is not None:
            page.stop()
    stats = consumer.stats
    click.echo(
        f"sink stopped: rows {dict(stats.rows)}, skipped {dict(stats.skipped)}, "
        f"dead-lettered {dict(stats.deadlettered)}, dead letters not published {stats.deadletter_errors}"
    )
