"""``runwatch runs``: the stored runs, newest first, through the local page when a stack owns the
store (sinks/page/), else from the store itself."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import click

from runwatch.cli.failure import DSN_HELP, fail
from runwatch.cli.needs import NeedsExtra
from runwatch.cli.output import print_json


def read_runs(dsn: str | None) -> list[dict[str, Any]]:
    """The runs list as JSON rows: from a live page serving ``dsn``'s store, else from the store."""
    from runwatch.cli.startup import open_sink
    from runwatch.sinks.clickhouse import default_dsn
    from runwatch.sinks.page import PageError, find_page

    page = find_page(dsn or default_dsn())
    if page is not None:
        try:
            return page.runs()
        except (OSError, PageError) as exc:
            fail(f"the local page at {page.url} failed: {exc}")
    sink = open_sink(dsn)
    try:
        return [r.model_dump(mode="json") for r in sink.runs.overview(datetime.now(UTC))]
    except Exception as exc:  # noqa: BLE001 - ClickHouse failing mid-way
        fail(f"reading ClickHouse at {sink.dsn} failed: {type(exc).__name__}: {exc}")
    finally:
        sink.close()


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{key} {n}" for key, n in counts.items() if n) or "-"


@click.command(cls=NeedsExtra, extras=["sink"])
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help=DSN_HELP)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def runs(dsn: str | None, as_json: bool) -> None:
    """List the stored runs, newest first: status, attempt, last step, findings by severity, actions
    by kind, rollbacks and the baseline verdict at run end. Works while `runwatch up` (or a sink with
    --page) holds the store: it reads through its page."""
    rows = read_runs(dsn)
    if as_json:
        print_json({"runs": rows})
        return
    if not rows:
        click.echo("no runs stored")
        return
    header = ("run", "status", "attempt", "last step", "findings", "actions", "baseline")
    table = [
        (
            r["run_id"],
            r["status"],
            (r["attempt"] or "-")[:12],
            "-" if r["last_step"] is None else str(r["last_step"]),
            _counts(r["findings"]),
            _counts(r["actions"]),
            "OUTLIER" if r["baseline_outliers"] else "-",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in (header, *table)) for i in range(len(header))]
    for row in (header, *table):
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
