"""``runwatch remediate``: command templates and webhooks for signed actions."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from runwatch.cli.failure import CommandError
from runwatch.cli.needs import NeedsExtra
from runwatch.cli.options import BOOTSTRAP_HELP, ready_file_option
from runwatch.cli.repeats import quiet_repeats
from runwatch.cli.signals import run_until_signalled
from runwatch.contract import topics


@click.command(cls=NeedsExtra, extras=["remediate"])
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, required=True, help=BOOTSTRAP_HELP)
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="remediation YAML: rules (action kinds -> argv command templates) and webhooks",
)
@click.option(
    "--dsn",
    envvar="RUNWATCH_REMEDIATE_DSN",
    help="ClickHouse DSN for the remediations record; default chdb:///.runwatch/remediate "
    "(give it a ClickHouse server shared with the sink to resolve {job_id}/{host}/{pod} from run_start)",
)
@ready_file_option
def remediate(bootstrap: str, config_path: str, dsn: str | None, ready_file: Path | None) -> None:
    """Run command templates and post to webhooks for signed actions (group runwatch-remediate)."""
    from runwatch.cli.startup import open_store, require_topics, writable_dir
    from runwatch.contract.signing import MissingKeyError, resolve_public_keys
    from runwatch.detectors.configfile import ConfigError
    from runwatch.sinks.remediate.config import load_remediation_config
    from runwatch.sinks.remediate.consumer import RemediateConsumer
    from runwatch.sinks.remediate.record import RemediationStore

    try:
        config = load_remediation_config(config_path)
        public_keys = resolve_public_keys()  # verifies the workers' actions; cannot sign one
    except (ConfigError, MissingKeyError) as exc:
        raise CommandError(str(exc)) from None
    if dsn is None:  # its own embedded path: a chdb path is open in one process at a time (the sink's)
        folder = writable_dir(Path(".runwatch"), "give --dsn, or start it where this user can write")
        dsn = f"chdb://{(folder / 'remediate').resolve()}"
    store = open_store(dsn)
    try:
        require_topics(bootstrap, [topics.ACTIONS])
    except CommandError:
        store.close()
        raise
    # (after the startup checks: what a client library logs while it retries is not the one line)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # its connection chatter: about 80 lines a start
    quiet_repeats("kafka")  # and a broker gone away: one line per kind every 30 s, not 10 a second
    consumer = RemediateConsumer(config, public_keys, RemediationStore(store), bootstrap)
    n_commands = sum(len(rule.commands) for rule in config.rules)
    click.echo(
        f"remediate: {n_commands} command template(s), {len(config.webhooks)} webhook(s); "
        f"record in {store.dsn}; {len(consumer.remediator.done)} execution(s) already recorded"
    )
    run_until_signalled(consumer, store, ready_file)
    rem = consumer.remediator
    click.echo(f"remediate stopped: executions {dict(rem.executed)}, ignored {dict(rem.ignored)}")
