"""The ``runwatch`` command line: up, runs, broker, worker, sink, remediate, migrate, demo, scenarios,
config, replay, evaluate, calibrate, ingest, baseline, hosts, report, grafana, keys, simulate, launch; each
command group in its own module, imported lazily inside the command (the CLI starts fast)."""

from __future__ import annotations

import logging

import click

from runwatch.cli import (
    baseline,
    broker,
    config,
    demo,
    grafana,
    hosts,
    ingest,
    keys,
    launch,
    migrate,
    offline,
    remediate,
    report,
    runs,
    scenarios,
    simulate,
    sink,
    up,
    worker,
)
from runwatch.cli.needs import RunwatchGroup
from runwatch.contract import logsafe


@click.group(cls=RunwatchGroup)
def main() -> None:
    """runwatch: see training regressions while the run is still going, and act on them."""
    logsafe.install()  # what a client sent (a run id, a module name) cannot forge a log line
    # clickhouse-connect logs a failed request before raising it; the command says it once, in its line
    logging.getLogger("clickhouse_connect").setLevel(logging.CRITICAL)


for command in (
    up.up,
    runs.runs,
    broker.broker,
    worker.worker,
    sink.sink,
    remediate.remediate,
    demo.demo,
    scenarios.scenarios,
    config.config,
    offline.replay,
    offline.evaluate,
    offline.calibrate,
    ingest.ingest,
    baseline.baseline,
    hosts.hosts,
    report.report,
    grafana.grafana,
    migrate.migrate,
    keys.keys,
    simulate.simulate,
    launch.launch,
):
    main.add_command(command)


if __name__ == "__main__":
    main()
