"""``runwatch launch``: run a training process under a small supervisor that reports its death (issue 39;
docs/launch.md). Training side: no extra needed."""

from __future__ import annotations

import os
import sys

import click

from runwatch.cli.failure import CommandError


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--run-id", envvar="RUNWATCH_RUN_ID", help="the run (default $RUNWATCH_RUN_ID)")
@click.option("--rank", type=int, default=None, help="this process's rank (default $RANK, ..., else 0)")
@click.option("--world-size", type=int, default=None, help="the run's ranks (default $WORLD_SIZE, ...)")
@click.option("--bootstrap", envvar="RUNWATCH_BOOTSTRAP", default="127.0.0.1:9092", show_default=True)
@click.option(
    "--host", default=None, help="the host name to report (default $RUNWATCH_HOST, else this host's)"
)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def launch(
    run_id: str | None,
    rank: int | None,
    world_size: int | None,
    bootstrap: str,
    host: str | None,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND (after `--`) and report its crash: a signal, a non-zero exit, an OOM kill, with its
    faulthandler text and the tail of its output, as a `crash` event the worker classifies."""
    from runwatch.producer.publish.events import require_run_id
    from runwatch.producer.publish.launcher import Launcher
    from runwatch.producer.publish.metadata import detect_rank_world

    if not run_id:
        raise CommandError("runwatch launch: give --run-id or set RUNWATCH_RUN_ID (the run the process is)")
    try:
        require_run_id(run_id)
    except ValueError as exc:
        raise CommandError(f"runwatch launch: {exc}") from None
    detected_rank, detected_world = detect_rank_world()
    launcher = Launcher(
        command,
        run_id=run_id,
        rank=detected_rank if rank is None else rank,
        world_size=detected_world if world_size is None else world_size,
        bootstrap=bootstrap,
        host=host,
        env=os.environ,
    )
    try:
        code = launcher.run()
    except FileNotFoundError as exc:
        raise CommandError(f"runwatch launch: {exc}") from None
    sys.exit(code)
