"""``runwatch worker``: the Faust detection worker."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import click

from runwatch.cli import extras
from runwatch.cli.failure import CommandError
from runwatch.cli.needs import NeedsExtra, require, require_engine
from runwatch.cli.options import BOOTSTRAP_HELP, cli_config, ready_file_option
from runwatch.contract import topics

if TYPE_CHECKING:
    from runwatch.worker.metrics_server import MetricsServer
    from runwatch.worker.otlp_export import OtlpExporter


@click.command(cls=NeedsExtra, extras=["worker"])
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, required=True, help=BOOTSTRAP_HELP)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="detector/policy YAML")
@click.option(
    "--web-port",
    type=int,
    default=6066,
    show_default=True,
    help="health endpoint port (/livez, /readyz, /health; one per worker); 0 turns it off",
)
@click.option(
    "--web-host",
    default="127.0.0.1",
    show_default=True,
    help="address the health and metrics endpoints listen on (0.0.0.0 for probes and scrapes from "
    "outside the host or pod)",
)
@click.option(
    "--metrics-port",
    type=int,
    default=0,
    envvar="RUNWATCH_METRICS_PORT",
    show_default=True,
    help="Prometheus metrics port (GET /metrics on --web-host; docs/operations.md lists the metrics); "
    "0 turns it off",
)
@click.option(
    "--otlp-endpoint",
    metavar="URL",
    envvar="RUNWATCH_OTLP_ENDPOINT",
    help="push the same metrics over OTLP/HTTP to this OpenTelemetry endpoint (e.g. http://collector:4318; "
    "/v1/metrics is appended); unset: no export (the default; an $OTEL_EXPORTER_OTLP_ENDPOINT meant for "
    "other programs does not turn it on). Needs the 'otlp' extra",
)
@click.option(
    "--otlp-interval-s",
    type=click.FloatRange(min=0.1),
    default=15.0,
    show_default=True,
    help="seconds between OTLP exports",
)
@click.option(
    "--detector-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="seconds the detector process may leave a request unanswered before the worker fails",
)
@click.option(
    "--delivery-timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="seconds the broker may take to acknowledge the worker's records before the worker fails",
)
@ready_file_option
@click.option(
    "--group",
    default=topics.DETECT_GROUP,
    show_default=True,
    help="consumer group (Faust app id): workers of one group share the runs; another group is a "
    "separate deployment, e.g. with another config",
)
@click.option(
    "--baseline-dsn",
    envvar="RUNWATCH_BASELINE_DSN",
    help="ClickHouse DSN each run's history is loaded from at its start: the per-step band of the "
    "baseline_trajectory detector, and the summaries its end is checked against (an outlier "
    "alert); an on-disk chdb path must be one no other process holds",
)
@click.option(
    "--no-state",
    is_flag=True,
    help="keep runs' state in memory only: a restart or a rebalance re-warms the moved runs' detectors",
)
@click.option(
    "--snapshot-every-events",
    type=int,
    default=1000,
    show_default=True,
    help="snapshot a run's state after this many of its events",
)
@click.option(
    "--snapshot-interval",
    type=float,
    default=5.0,
    show_default=True,
    help="seconds between checkpoints (every changed run's state; events are committed after one)",
)
@click.option(
    "--state-retention",
    type=float,
    default=3600.0,
    show_default=True,
    help="seconds an ended run's marker stays in runwatch.state before it is deleted",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".runwatch") / "worker",
    show_default=True,
    help="Faust's own files (its offsets' table and such); said at start",
)
@click.option("--loglevel", default="WARNING", show_default=True)
def worker(
    bootstrap: str,
    config_path: str | None,
    web_port: int,
    web_host: str,
    metrics_port: int,
    otlp_endpoint: str | None,
    otlp_interval_s: float,
    detector_timeout: float,
    delivery_timeout: float,
    ready_file: Path | None,
    group: str,
    baseline_dsn: str | None,
    no_state: bool,
    snapshot_every_events: int,
    snapshot_interval: float,
    state_retention: float,
    data_dir: Path,
    loglevel: str,
) -> None:
    """Run the Faust detection worker."""
    if baseline_dsn:  # the history is read from ClickHouse
        require("runwatch worker --baseline-dsn", ["sink"])
        require_engine("runwatch worker --baseline-dsn", baseline_dsn)
    from pydantic import ValidationError

    from runwatch.contract.signing import MissingKeyError, resolve_signing_key
    from runwatch.worker.health_server import HealthServer
    from runwatch.worker.state.run_states import StateOptions

    server = None
    if web_port:  # first: a supervisor's probe is answered from the first second (live, starting)
        try:
            server = HealthServer(web_host, web_port).start()
        except OSError as exc:
            raise CommandError(
                f"the health endpoint cannot listen on {web_host}:{web_port}: {exc.strerror} "
                "(another worker there? give each its own --web-port, or 0 for none)"
            ) from None
    metrics = _metrics_server(web_host, metrics_port) if metrics_port else None
    endpoint = otlp_metrics_endpoint(otlp_endpoint, os.environ)
    otlp = _otlp_exporter(endpoint, otlp_interval_s) if endpoint else None
    config = cli_config(config_path)
    from runwatch.cli.startup import writable_dir

    # (Faust makes only the last level, and fails late)
    writable_dir(data_dir, "give --data-dir a folder this user can write")
    from runwatch.worker.state.snapshot import resolve_state_secret

    try:
        # (the workers' private key: only they sign actions; trainers hold its public key)
        secret = resolve_signing_key().seed
        # (the snapshots' key: the workers' own, never one a trainer holds)
        state_secret = None if no_state else resolve_state_secret(action_secret=secret)
    except MissingKeyError as exc:
        raise CommandError(str(exc)) from None
    try:
        state = StateOptions(
            enabled=not no_state,
            every_events=snapshot_every_events,
            interval_s=snapshot_interval,
            retention_s=state_retention,
        )
    except ValidationError as exc:
        raise CommandError(
            f"bad snapshot option: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}"
        ) from None
    if server is not None:
        server.starting.phase = f"reaching the Kafka broker at {bootstrap}"
    partitions = _check_topics(bootstrap, state.enabled)
    if server is not None:
        server.starting.phase = "starting Faust and the detector process"
    from runwatch.worker.app import create_app, run_worker

    app, _ = create_app(
        bootstrap,
        config,
        secret,
        app_id=group,
        web_port=None,
        ready_file=ready_file,
        detector_timeout_s=detector_timeout,
        delivery_timeout_s=delivery_timeout,
        baseline_dsn=baseline_dsn,
        state=state,
        state_secret=state_secret,
        partitions=partitions,
        health_server=server,
        data_dir=data_dir,
        metrics_server=metrics,
        otlp_exporter=otlp,
    )
    click.echo(f"runwatch worker: group {group} on {bootstrap}; Faust's files in {data_dir.resolve()}")
    sys.argv = [sys.argv[0]]  # Faust's Worker parses argv; ours are already consumed
    run_worker(app, loglevel=loglevel)


def _metrics_server(host: str, port: int) -> MetricsServer:
    try:
        from runwatch.worker.metrics_server import MetricsServer
    except ImportError as exc:  # (prometheus_client: the worker extra has it; an older install may not)
        raise CommandError(
            f"runwatch worker --metrics-port needs prometheus_client ({exc}): pip install 'runwatch[worker]'"
        ) from None
    try:
        return MetricsServer(host, port)
    except OSError as exc:
        raise CommandError(
            f"the metrics endpoint cannot listen on {host}:{port}: {exc.strerror} "
            "(another worker there? give each its own --metrics-port, or 0 for none)"
        ) from None


OTLP_OPTION = "runwatch worker --otlp-endpoint"
METRICS_PATH = "/v1/metrics"


def otlp_metrics_endpoint(option: str | None, environ: Mapping[str, str]) -> str | None:
    """The full URL metrics are pushed to: the option's (a base URL, like ``OTEL_EXPORTER_OTLP_ENDPOINT``;
    ``/v1/metrics`` appended unless it ends so); None: no export. Only the option (or
    ``RUNWATCH_OTLP_ENDPOINT``) turns the export on: a cluster that sets ``OTEL_EXPORTER_OTLP_ENDPOINT`` for
    its instrumented programs must not make a worker without the extra refuse to start. (``environ`` is
    kept for the SDK's other ``OTEL_EXPORTER_OTLP_*`` settings, which it reads itself.)"""
    del environ
    return _with_metrics_path(option) if option else None


def _with_metrics_path(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith(METRICS_PATH) else base + METRICS_PATH


def _otlp_exporter(endpoint: str, interval_s: float) -> OtlpExporter:
    # (the extra per the installed metadata first; then the import, for an install older than it)
    line = extras.check(OTLP_OPTION, ["otlp"])
    if line is not None:
        raise CommandError(line)
    try:
        from runwatch.worker.otlp_export import OtlpExporter
    except ImportError as exc:
        raise CommandError(
            extras.for_missing_module(OTLP_OPTION, exc.name or "", ["otlp"])
            or f"{OTLP_OPTION} cannot import {exc.name} ({exc}): pip install 'runwatch[otlp]'"
        ) from None
    return OtlpExporter(endpoint, interval_s)


def _check_topics(bootstrap: str, state: bool) -> int:
    """The broker answers within CONNECT_TIMEOUT_S, the telemetry topic exists, and (with durable state)
    runwatch.state exists with the same partition count: a run's snapshot goes to the partition number its
    telemetry comes from, and is read back when that partition is assigned. Returns the telemetry topic's
    partition count (each record's partition is checked against its key's)."""
    from runwatch.cli.startup import require_topics

    counts = require_topics(bootstrap, [topics.TELEMETRY], optional=[topics.STATE])
    telemetry, state_count = counts[topics.TELEMETRY], counts[topics.STATE]
    assert telemetry is not None  # (required)
    if not state:
        return telemetry
    if state_count is None:
        raise CommandError(
            f"the topic {topics.STATE} does not exist on {bootstrap}: create it compacted "
            f"(cleanup.policy=compact) with as many partitions as {topics.TELEMETRY} (`runwatch broker "
            "--bootstrap ...` creates it; deploy/ lists it), or run with --no-state"
        )
    if state_count != telemetry:
        raise CommandError(
            f"{topics.STATE} has {state_count} partitions and {topics.TELEMETRY} {telemetry}: they must be "
            "equal (a run's snapshot goes to the partition number of its telemetry)"
        )
    return telemetry
