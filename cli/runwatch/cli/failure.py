"""How every command fails: one line on stderr and an exit code, never a traceback.

One convention for exit codes (docs/operations.md#exit-codes):

- 0: done; a check passed;
- 1 (``EXIT_VERDICT``): a check's verdict, for CI: ``baseline check`` found an outlier, ``grafana generate
  --check`` found files out of date; and a long-running service (worker, sink, remediator) that failed
  after it started, for its supervisor to restart;
- 2 (``EXIT_ERROR``): the command could not do its job: bad usage or input, a broker or ClickHouse that
  does not answer at start, a missing extra. One line on stderr, ``error: ...``, never a traceback.
"""

from __future__ import annotations

from typing import Any, NoReturn

import click

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
