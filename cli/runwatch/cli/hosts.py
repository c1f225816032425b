"""``runwatch hosts``: the hosts that keep failing over a job's history (issue 39,
sinks/runwatch/sinks/hosts.py), read from ClickHouse."""

from __future__ import annotations

from dataclasses import asdict

import click

from runwatch.cli.failure import DSN_HELP, fail
from runwatch.cli.needs import NeedsExtra
from runwatch.cli.output import print_json


@click.command(cls=NeedsExtra, extras=["sink"])
@click.option("--job", help="this job's runs only (run_start's job_id); default: every job")
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help=DSN_HELP)
@click.option("--window-days", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True)
@click.option(
    "--min-runs",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="distinct runs that name a host",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def hosts(job: str | None, dsn: str | None, window_days: float, min_runs: int, as_json: bool) -> None:
    """The hosts that findings about one of their ranks (straggler, hung rank, stall, non-finite, replica
    divergence) or crashes point at in at least --min-runs runs of the job: the candidates to leave out of
    the next restart. A job that ran on one host names none."""
    from runwatch.cli.startup import open_sink
    from runwatch.sinks.hosts import lemon_hosts

    sink = open_sink(dsn)
    try:
        named = lemon_hosts(sink, job=job, window_days=window_days, min_runs=min_runs)
    except Exception as exc:  # noqa: BLE001 - ClickHouse failing mid-way
        fail(f"reading ClickHouse at {sink.dsn} failed: {type(exc).__name__}: {exc}")
    finally:
        sink.close()
    if as_json:
        print_json(
            {
                "job": job,
                "window_days": window_days,
                "min_runs": min_runs,
                "hosts": [asdict(h) for h in named],
            }
        )
        return
    scope = f"job {job}" if job else "every job"
    if not named:
        click.echo(f"no host failed in {min_runs}+ runs of {scope} in the last {window_days:g} days")
        return
    click.echo(
        f"{len(named)} host(s) failed in {min_runs}+ runs of {scope} in the last {window_days:g} days:"
    )
    for h in named:
        click.echo(
            f"  {h.host}: {len(h.run_ids)} runs ({h.findings} finding(s), {h.crashes} crash(es)): "
            + ", ".join(h.run_ids)
        )
