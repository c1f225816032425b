"""What several commands share: the bootstrap option's help and the detector/policy config they load."""

from __future__ import annotations

import click

from runwatch.producer import topics

BOOTSTRAP_HELP = f"Kafka bootstrap host:port[,host:port]; default ${topics.BOOTSTRAP_ENV}"


def cli_config(path: str | None):  # noqa: ANN201 - a RunwatchConfig, imported late (the CLI starts fast)
    """The detector/policy config at ``path`` (the defaults if None); a bad file is a usage error."""
    from runwatch.detectors import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
