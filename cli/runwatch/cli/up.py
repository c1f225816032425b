"""``runwatch up``: the whole stack on this machine in one command (local/runwatch/local/stack.py)."""

from __future__ import annotations

import errno
import os
import shlex
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from runwatch.local.stack import LocalStack

from runwatch.cli.failure import EXIT_VERDICT, CommandError
from runwatch.cli.needs import NeedsExtra
from runwatch.contract import topics


@click.command(cls=NeedsExtra, extras=["server", "embedded"])
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(".runwatch"),
    show_default=True,
    help="the store, the keys, the logs and the worker's files",
)
@click.option("--bootstrap", help="an existing Kafka instead of the embedded broker")
@click.option("--dsn", help="an existing ClickHouse (http(s)://...) instead of the embedded store")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="the workers' YAML",
)
@click.option(
    "--remediate-config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="also run the remediator with this YAML",
)
@click.option("--page-host", default="127.0.0.1", show_default=True, help="where the local page listens")
@click.option("--page-port", type=int, default=8750, show_default=True, help="0 picks a free port")
def up(
    state_dir: Path,
    bootstrap: str | None,
    dsn: str | None,
    config_path: Path | None,
    remediate_config: Path | None,
    page_host: str,
    page_port: int,
) -> None:
    """Start the embedded broker, the worker, the sink, the local page (and the remediator with
    --remediate-config) until Ctrl-C; print what to export in the training shell.

    With --bootstrap and --dsn (a real Kafka and ClickHouse) it starts only the worker, the sink and
    the page. Ctrl-C stops the worker, lets the sink store every record left on the broker, then stops
    the rest."""
    import logging

    from runwatch.contract.signing import MissingKeyError
    from runwatch.local.stack import LocalStack, StackOptions
    from runwatch.local.state_lock import StateFolderHeld

    # The parts log to files; here only what goes wrong (the client libraries' retry chatter included).
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # (kafka-python's reconnect chatter: the stack says itself what failed)
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    options = StackOptions(
        state_dir=state_dir,
        bootstrap=bootstrap,
        dsn=dsn,
        config_path=config_path,
        remediate_config=remediate_config,
        page_host=page_host,
        page_port=page_port,
    )
    stack = LocalStack(options, say=click.echo)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        stack.start()
    except (MissingKeyError, StateFolderHeld) as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise CommandError(
                f"the page's port {page_port} on {page_host} is in use: "
                "give --page-port N (0 picks a free one)"
            ) from None
        raise CommandError(f"{type(exc).__name__}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a part that did not start, said in one line
        raise CommandError(f"the stack did not start: {type(exc).__name__}: {exc}") from None
    _print_exports(stack)
    failed = _wait(stack, stopping)
    click.echo("stopping: the worker, then the sink once it has stored everything, then the rest")
    stack.stop()
    click.echo("stopped")
    if failed:
        raise SystemExit(EXIT_VERDICT)


def _print_exports(stack: LocalStack) -> None:
    state = stack.options.state_dir.resolve()
    keys = stack.action_keys
    assert keys is not None
    env_file = state / "env"
    # The public key only: it verifies the worker's actions and cannot sign one (the signing key stays with
    # the worker). Written out, not read from a file: the env file is sourced from any folder.
    lines = [
        f"export {topics.BOOTSTRAP_ENV}={stack.bootstrap}",
        f"export {topics.PUBLIC_KEYS_ENV}={shlex.quote(keys.public_keys.text)}",
    ]
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("\n".join(lines) + "\n")
    assert stack.sink is not None and stack.page is not None
    broker = "embedded, in memory" if stack.broker is not None else "given"
    click.echo(f"runwatch is up:\n  broker  {stack.bootstrap} ({broker})\n  page    {stack.page.url}")
    click.echo(f"  store   {stack.sink.dsn}\n  logs    {stack.logs}")
    if keys.signing_key_file is not None:
        click.echo(f"  key     {keys.signing_key_file} (the worker's signing key, readable by you only)")
    click.echo(f"In the training shell (or: source {shlex.quote(str(env_file))}):")
    for line in lines:
        click.echo(f"  {line}")
    click.echo("Ctrl-C stops everything.")


def _wait(stack: LocalStack, stopping: threading.Event) -> bool:
    """Until Ctrl-C (False) or a part ends on its own: the broker, the worker, the sink or the remediator
    (True: said, and the stack then stops)."""
    while not stopping.wait(0.5):
        dead = stack.dead_part()
        if dead is not None:
            click.echo(f"error: {dead}; stopping the rest", err=True)
            return True
    return False
