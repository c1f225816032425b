"""The ``runwatch`` command line: broker, worker, sink, remediate, demo, config, replay, evaluate, calibrate."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

import click
import orjson

from runwatch.producer import topics
from runwatch.streams import offline_cli

BOOTSTRAP_HELP = f"Kafka bootstrap host:port[,host:port]; default ${topics.BOOTSTRAP_ENV}"


def _run_until_signalled(consumer, store) -> None:  # noqa: ANN001 - a sink or remediate consumer, its store
    """Run ``consumer`` until SIGINT/SIGTERM asks it to stop, then close ``store``."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: consumer.stopping.set())
    try:
        consumer.run()
    finally:
        store.close()


def _outage_window(_ctx, _param, value: str | None) -> tuple[float, float] | None:  # noqa: ANN001
    if value is None:
        return None
    try:
        start, end = (float(x) for x in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not START:END, e.g. 0.33:0.66") from None
    if not 0.0 <= start < end <= 1.0:
        raise click.BadParameter(f"{value!r}: need 0 <= START < END <= 1 (fractions of the run's steps)")
    return start, end


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


@click.group()
def main() -> None:
    """runwatch: see training regressions while the run is still going, and act on them."""


@main.command()
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, help="use this Kafka instead of starting one")
@click.option("--port", type=int, default=None, help="port for the embedded broker (default: a free one)")
@click.option("--partitions", type=int, default=topics.DEFAULT_PARTITIONS, show_default=True)
def broker(bootstrap: str | None, port: int | None, partitions: int) -> None:
    """Start the embedded Tansu broker and create the topics (or just create them on --bootstrap).

    The embedded broker keeps everything in memory: see docs/embedded-broker.md for its limits.
    """
    from runwatch.streams.broker import BrokerError, EmbeddedBroker, ensure_topics

    if bootstrap and port is not None:
        # --port asks for an embedded broker, a bootstrap for an existing Kafka: never pick one silently.
        ctx = click.get_current_context()
        if ctx.get_parameter_source("bootstrap") is click.core.ParameterSource.ENVIRONMENT:
            raise click.UsageError(
                f"--port {port} starts an embedded broker, but {topics.BOOTSTRAP_ENV}={bootstrap} is set, "
                f"which means: use that Kafka (it would win, and nothing would listen on port {port}). "
                f"Unset it (`unset {topics.BOOTSTRAP_ENV}`) to start the embedded broker on port {port}, "
                f"or drop --port to create the topics on {bootstrap}."
            )
        raise click.UsageError(
            f"--port {port} starts an embedded broker, --bootstrap {bootstrap} uses an existing Kafka: "
            "give one of them."
        )
    try:
        if bootstrap:
            created = ensure_topics(bootstrap, partitions)
            click.echo(f"topics on {bootstrap}: created {created or 'none (all present)'}")
            return
        with EmbeddedBroker(port=port) as embedded:
            ensure_topics(embedded.bootstrap, partitions)
            click.echo(f"embedded broker listening on {embedded.bootstrap}")
            click.echo("in memory only: stopping it loses every event and offset (docs/embedded-broker.md)")
            click.echo(f"export {topics.BOOTSTRAP_ENV}={embedded.bootstrap}")
            click.echo("Ctrl-C to stop")
            _wait_for_signal()
        click.echo("broker stopped")
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
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
@click.option("--loglevel", default="WARNING", show_default=True)
def worker(bootstrap: str, config_path: str | None, web_port: int, web_host: str, detector_timeout: float,
           delivery_timeout: float, ready_file: str | None, group: str, loglevel: str) -> None:
    """Run the Faust detection worker."""
    from runwatch.producer.signing import MissingSecretError, resolve_secret
    from runwatch.streams.app import create_app, run_worker

    config = offline_cli.cli_config(config_path)
    try:
        secret = resolve_secret()
    except MissingSecretError as exc:
        raise click.ClickException(str(exc)) from None
    app, _ = create_app(bootstrap, config, secret, app_id=group, web_port=web_port or None, web_host=web_host,
                        ready_file=Path(ready_file) if ready_file else None, detector_timeout_s=detector_timeout,
                        delivery_timeout_s=delivery_timeout)
    sys.argv = [sys.argv[0]]  # Faust's Worker parses argv; ours are already consumed
    run_worker(app, loglevel=loglevel)


@main.command()
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, required=True, help=BOOTSTRAP_HELP)
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help="chdb:///path or http(s)://user:pass@host:8123")
@click.option("--batch-size", type=int, default=2000, show_default=True)
@click.option("--batch-interval", type=float, default=1.0, show_default=True, help="seconds")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="the workers' YAML: its `limits:` decide which telemetry is stored (the same as the workers')")
def sink(bootstrap: str, dsn: str | None, batch_size: int, batch_interval: float, config_path: str | None) -> None:
    """Store telemetry, anomalies, actions and dead letters in ClickHouse (group runwatch-sink)."""
    from runwatch.sinks import ClickHouseSink, SinkConsumer

    limits = offline_cli.cli_config(config_path).limits
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = ClickHouseSink(dsn)
    applied = store.migrate()
    click.echo(f"ClickHouse {store.dsn}: schema v{store.schema_version()} (applied now: {applied or 'none'})")
    consumer = SinkConsumer(store, bootstrap, batch_size=batch_size, batch_interval_s=batch_interval, limits=limits)
    _run_until_signalled(consumer, store)
    stats = consumer.stats
    click.echo(f"sink stopped: rows {dict(stats.rows)}, skipped {dict(stats.skipped)}, "
               f"dead-lettered {dict(stats.deadlettered)}, dead letters not published {stats.deadletter_errors}")


@main.command()
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, required=True, help=BOOTSTRAP_HELP)
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="remediation YAML: rules (action kinds -> argv command templates) and webhooks")
@click.option("--dsn", envvar="RUNWATCH_REMEDIATE_DSN",
              help="ClickHouse DSN for the remediations record; default chdb:///.runwatch/remediate "
                   "(give it a ClickHouse server shared with the sink to resolve {job_id}/{host}/{pod} from run_start)")
def remediate(bootstrap: str, config_path: str, dsn: str | None) -> None:
    """Run command templates and post to webhooks for signed actions (group runwatch-remediate)."""
    from runwatch.configfile import ConfigError
    from runwatch.producer.signing import MissingSecretError, resolve_secret
    from runwatch.sinks import ClickHouseSink
    from runwatch.sinks.remediate import RemediateConsumer, RemediationStore, load_remediation_config

    try:
        config = load_remediation_config(config_path)
        secret = resolve_secret()
    except (ConfigError, MissingSecretError) as exc:
        raise click.ClickException(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Its own embedded path by default: a chdb path is open in one process at a time (the sink's).
    store = ClickHouseSink(dsn or f"chdb://{(Path('.runwatch') / 'remediate').resolve()}")
    store.migrate()
    consumer = RemediateConsumer(config, secret, RemediationStore(store), bootstrap)
    n_commands = sum(len(rule.commands) for rule in config.rules)
    click.echo(f"remediate: {n_commands} command template(s), {len(config.webhooks)} webhook(s); "
               f"record in {store.dsn}; {len(consumer.remediator.done)} execution(s) already recorded")
    _run_until_signalled(consumer, store)
    rem = consumer.remediator
    click.echo(f"remediate stopped: executions {dict(rem.executed)}, ignored {dict(rem.ignored)}")


@main.command()
@click.option("--scenario", default="nan", show_default=True,
              help="healthy, nan or grad-spike: the small demo model, with rollback; or any scenario name of "
                   "`runwatch scenarios generate` (e.g. stall_hang_train), streamed live on a simulated clock")
@click.option("--steps", type=click.IntRange(min=20), default=300, show_default=True)
@click.option("--fault-step", type=int, default=None, help="default: just after half way")
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, help="use this Kafka instead of the embedded broker")
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help="ClickHouse DSN; default chdb:///.runwatch/clickhouse")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), help="detector/policy YAML")
@click.option("--no-worker", is_flag=True, help="a worker is already running against --bootstrap")
@click.option("--step-interval", type=float, default=0.02, show_default=True, help="minimum seconds per step")
@click.option("--broker-outage", metavar="START:END", callback=_outage_window,
              help="cut every client off the (embedded) broker between these fractions of the run's steps, "
                   "e.g. 0.33:0.66; the trainer spools to disk and replays")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the summary")
def demo(scenario: str, steps: int, fault_step: int | None, bootstrap: str | None, dsn: str | None,
         config_path: str | None, no_worker: bool, step_interval: float,
         broker_outage: tuple[float, float] | None, as_json: bool) -> None:
    """Train a small model with a fault injected and watch runwatch catch it."""
    from runwatch.streams.demo import DemoError, DemoOptions, run_demo
    from runwatch.streams.demo_render import DemoConsole
    from runwatch.streams.demo_training import SCENARIOS as DEMO_SCENARIOS
    from runwatch.streams.scenarios import SCENARIOS

    if scenario not in DEMO_SCENARIOS and scenario not in SCENARIOS:
        raise click.BadParameter(f"{scenario!r}; choose one of {', '.join([*DEMO_SCENARIOS, *SCENARIOS])}",
                                 param_hint="--scenario")
    if scenario in SCENARIOS:
        steps = SCENARIOS[scenario].n_steps(False)  # a recorded scenario has its own length
    if config_path:
        offline_cli.cli_config(config_path)  # fail here, not in the worker process
    opts = DemoOptions(scenario=scenario, steps=steps, fault_step=fault_step, bootstrap=bootstrap, dsn=dsn,
                       config_path=Path(config_path) if config_path else None, start_worker=not no_worker,
                       step_interval_s=step_interval, broker_outage=broker_outage)
    console = DemoConsole(quiet=as_json, steps=steps)
    try:
        with console:
            report = run_demo(opts, log=console.log, on_step=console.step)
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        console.summary(report)


@main.group()
def scenarios() -> None:
    """Labelled training scenarios (faults and healthy runs) recorded as telemetry JSONL."""


@scenarios.command("generate")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--only", "only", multiple=True, metavar="NAME", help="record only this scenario (repeatable)")
@click.option("--quick", is_flag=True, help="far fewer steps per scenario (for tests)")
def scenarios_generate(out_dir: str, only: tuple[str, ...], quick: bool) -> None:
    """Train every scenario on the CPU and write OUT_DIR/<name>.jsonl and OUT_DIR/labels.json."""
    import time

    from runwatch.streams.scenarios import CATALOG, SCENARIOS, generate

    unknown = [n for n in only if n not in SCENARIOS]
    if unknown:
        raise click.BadParameter(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}",
                                 param_hint="--only")
    total = len(only) or len(CATALOG)
    done = [0]

    def progress(name: str, label: dict, seconds: float) -> None:
        done[0] += 1
        onset = "" if label["onset_step"] is None else f" onset step {label['onset_step']}"
        click.echo(f"[{done[0]:2d}/{total}] {name:36s} {label['fault']:22s} {label['steps']:4d} steps{onset}"
                   f"  ({seconds:.1f} s)")

    started = time.perf_counter()
    labels = generate(out_dir, list(only) or None, quick=quick, progress=progress)
    faults = sum(1 for lab in labels if lab["fault"] != "healthy")
    click.echo(f"{len(labels)} scenarios ({faults} faults, {len(labels) - faults} healthy) in "
               f"{time.perf_counter() - started:.1f} s -> {Path(out_dir) / 'labels.json'}")


@main.command()
@click.option("--defaults", is_flag=True, help="print the default configuration")
@click.argument("path", required=False, type=click.Path(exists=True, dir_okay=False))
def config(defaults: bool, path: str | None) -> None:
    """Validate a detector/policy YAML file, or print the defaults."""
    from runwatch.detectors.config import defaults_yaml

    if defaults or not path:
        click.echo(defaults_yaml(), nl=False)
        return
    offline_cli.cli_config(path)
    click.echo(f"{path}: valid")


# The offline commands: the same detector code as the worker, over recordings.
main.add_command(offline_cli.replay)
main.add_command(offline_cli.evaluate)
main.add_command(offline_cli.calibrate)


if __name__ == "__main__":
    main()
