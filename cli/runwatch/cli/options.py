"""What several commands share: the bootstrap option's help and the detector/policy config they load."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from runwatch.cli.failure import CommandError
from runwatch.contract import topics

if TYPE_CHECKING:
    from runwatch.detectors import RunwatchConfig

BOOTSTRAP_HELP = f"Kafka bootstrap host:port[,host:port]; default ${topics.BOOTSTRAP_ENV}"
READY_FILE_ENV = "RUNWATCH_READY_FILE"

# The long-running services' readiness for a supervisor without HTTP probes (and the deploy smoke test,
# which sets it in the environment so that the manifests' command lines run unchanged).
ready_file_option = click.option(
    "--ready-file",
    envvar=READY_FILE_ENV,
    type=click.Path(dir_okay=False, path_type=Path),
    help=f"written once the consumer group has given this process its partitions; default ${READY_FILE_ENV}",
)


def cli_config(path: str | None) -> RunwatchConfig:
    """The detector/policy config at ``path`` (the defaults if None); a bad file is a usage error."""
    from runwatch.detectors import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        raise CommandError(str(exc)) from None


def require_torch(command: str) -> None:
    """Stop ``command`` with one line naming the extra when torch cannot be imported: the commands that train
    real models need it, but a server's install (``pip install 'runwatch[server]'``) has none. (Their extras'
    distributions are checked first, by ``needs.NeedsExtra``; this catches a torch that is installed but does
    not import.)"""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise CommandError(
            f"{command} trains real models and needs PyTorch: pip install 'runwatch[torch]'"
        ) from None
