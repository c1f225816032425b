"""``runwatch config``: validate a detector/policy YAML, or print the defaults."""

from __future__ import annotations

import click

from runwatch.cli.needs import NeedsExtra
from runwatch.cli.options import cli_config


@click.command(cls=NeedsExtra, extras=["detectors"])
@click.option("--defaults", is_flag=True, help="print the default configuration")
@click.argument("path", required=False, type=click.Path(exists=True, dir_okay=False))
def config(defaults: bool, path: str | None) -> None:
    """Validate a detector/policy YAML file, or print the defaults."""
    from runwatch.detectors.config import defaults_yaml

    if defaults or not path:
        click.echo(defaults_yaml(), nl=False)
        return
    cli_config(path)
    click.echo(f"{path}: valid")
