"""``runwatch report RUN_ID``: one run's dashboards, findings, actions and baseline verdicts as one
self-contained HTML file (sinks/runwatch/sinks/report/)."""

from __future__ import annotations

from pathlib import Path

import click

from runwatch.cli.failure import DSN_HELP, fail
from runwatch.cli.needs import NeedsExtra


@click.command(cls=NeedsExtra, extras=["report"])
@click.argument("run_id")
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help=DSN_HELP)
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="the HTML file to write [default: report-RUN_ID.html here]",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="runwatch YAML whose `baseline` section judges the run (as `runwatch baseline check`)",
)
def report(run_id: str, dsn: str | None, out: Path | None, config_path: str | None) -> None:
    """Write RUN_ID's report: the Run and Baselines panels drawn with plotly.js (inlined: it opens with no
    network), anomalies and actions marked on the curves, the findings and the baseline verdicts.

    Exits 2 when the run is unknown or ClickHouse cannot be read."""
    from runwatch.cli.options import cli_config
    from runwatch.cli.startup import open_sink
    from runwatch.sinks.clickhouse import default_dsn
    from runwatch.sinks.page import PageError, find_page
    from runwatch.sinks.report import UnknownRun, default_out, write_report

    config = cli_config(config_path).baseline
    page = find_page(dsn or default_dsn())
    if page is not None:  # a running stack owns the store: read through its page
        try:
            html, panels = page.report(run_id, config.model_dump_json())
        except (OSError, PageError) as exc:
            fail(f"{exc} (through the local page at {page.url})")
        path = Path(out) if out is not None else default_out(run_id)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(html)
        except OSError as exc:
            fail(f"cannot write the report: {exc}")
        _said(run_id, path.resolve(), len(html.encode()), len(panels))
        return
    sink = open_sink(dsn)
    try:
        result = write_report(sink, run_id, out, config)
    except UnknownRun as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write the report: {exc}")
    except Exception as exc:  # noqa: BLE001 - ClickHouse failing mid-way
        fail(f"reading ClickHouse at {sink.dsn} failed: {type(exc).__name__}: {exc}")
    finally:
        sink.close()
    _said(run_id, result.path, result.bytes, len(result.panels))


def _said(run_id: str, path: Path, size: int, panels: int) -> None:
    click.echo(f"report of {run_id}: {path} ({size / 1e6:.1f} MB, {panels} panels)")
