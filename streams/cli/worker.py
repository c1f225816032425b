"""``runwatch worker``: the Faust detection worker."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from runwatch.producer import topics
from runwatch.streams.cli.options import BOOTSTRAP_HELP, cli_config


@click.command()
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, required=True, help=BOOTSTRAP_HELP)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="detector/policy YAML")
@click.option("--web-port", type=int, default=6066, show_default=True,
              help="health endpoint port (/livez, /readyz, /health; one per worker); 0 turns it off")
@click.option("--web-host", default="0.0.0.0", show_default=True, help="address the health endpoint listens on")
@click.option("--detector-timeout", type=float, default=30.0, show_default=True,
              help="seconds the detector process may leave a request unanswered before the worker fails")
@click.option("--delivery-timeout", type=float, default=60.0, show_default=True,
              help="seconds the broker may take to acknowledge the worker's records before the worker fails")
@click.option("--ready-file", type=click.Path(dir_okay=False), help="written once partitions are assigned")
@click.option("--group", default=topics.DETECT_GROUP, show_default=True,
              help="consumer group (Faust app id): workers of one group share the runs; another group is a "
                   "separate deployment, e.g. with another config")
@click.option("--baseline-dsn", envvar="RUNWATCH_BASELINE_DSN",
              help="ClickHouse DSN each run's history is loaded from at its start: the per-step band of the "
                   "baseline_trajectory detector, and the summaries its end is checked against (an outlier "
                   "alert); an on-disk chdb path must be one no other process holds")
@click.option("--loglevel", default="WARNING", show_default=True)
def worker(bootstrap: str, config_path: str | None, web_port: int, web_host: str, detector_timeout: float,
           delivery_timeout: float, ready_file: str | None, group: str, baseline_dsn: str | None,
           loglevel: str) -> None:
    """Run the Faust detection worker."""
    from runwatch.producer.signing import MissingSecretError, resolve_secret
    from runwatch.streams.worker.app import create_app, run_worker

    config = cli_config(config_path)
    try:
        secret = resolve_secret()
    except MissingSecretError as exc:
        raise click.ClickException(str(exc)) from None
    app, _ = create_app(bootstrap, config, secret, app_id=group, web_port=web_port or None, web_host=web_host,
                        ready_file=Path(ready_file) if ready_file else None, detector_timeout_s=detector_timeout,
                        delivery_timeout_s=delivery_timeout, baseline_dsn=baseline_dsn)
    sys.argv = [sys.argv[0]]  # Faust's Worker parses argv; ours are already consumed
    run_worker(app, loglevel=loglevel)
