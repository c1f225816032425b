"""How every command fails, and opening the sink with a clear error when ClickHouse cannot be reached.

One convention for exit codes (docs/operations.md#exit-codes):

- 0: done; a check passed;
- 1 (``EXIT_VERDICT``): a check's verdict, for CI: ``baseline check`` found an outlier, ``grafana generate
  --check`` found files out of date; and a long-running service (worker, sink, remediator) that failed
  after it started, for its supervisor to restart;
- 2 (``EXIT_ERROR``): the command could not do its job: bad usage or input, a broker or ClickHouse that
  does not answer at start, a missing extra. One line on stderr, ``error: ...``, never a traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import click

if TYPE_CHECKING:
    from runwatch.sinks.clickhouse import ClickHouseSink

EXIT_VERDICT = 1
EXIT_ERROR = 2
DSN_HELP = "chdb:///path or http(s)://user:pass@host:8123 (default: the sink's, chdb://.runwatch/clickhouse)"


class CommandError(click.ClickException):
    """The command could not do its job: click prints ``error: <message>`` on stderr and exits 2."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.format_message()}", err=True, file=file)


def fail(message: str) -> NoReturn:
    """Stop the command with ``error: message`` on stderr and exit 2 (a gate's "could not judge", never 0
    or 1)."""
    raise CommandError(message)


def open_sink(dsn: str | None) -> ClickHouseSink:
    """The ClickHouse sink at ``dsn`` (default: the sink's) for a command that reads it, migrated; exits 2
    saying why when there is nothing stored there, or it cannot be opened or reached."""
    from runwatch.cli.startup import open_store  # (startup raises this module's error)

    return open_store(dsn, create=False)
