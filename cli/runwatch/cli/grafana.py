"""``runwatch grafana``: the dashboards as code and their provisioning into a running Grafana."""

from __future__ import annotations

import sys
from collections import Counter

import click

from runwatch.cli.failure import EXIT_VERDICT, fail
from runwatch.cli.needs import NeedsExtra
from runwatch.cli.output import print_json
from runwatch.contract.logsafe import redacted

DEFAULT_DATASOURCE_URL = "native://runwatch_reader@clickhouse:9000/runwatch"


@click.group()
def grafana() -> None:
    """Grafana dashboards on ClickHouse: generate them, provision them into a Grafana."""


@grafana.command(cls=NeedsExtra, extras=["grafana"], without=["grafana-client"])
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="deploy/grafana/dashboards",
    show_default=True,
    help="the directory to write the dashboards' JSON files to",
)
@click.option("--database", default="runwatch", show_default=True, help="the sink's ClickHouse database")
@click.option(
    "--check",
    is_flag=True,
    help="write nothing; exit 1 when the files in --out differ from a fresh generation",
)
def generate(out_dir: str, database: str, check: bool) -> None:
    """Write the five dashboards (Fleet, Run, Ranks, Baselines, Pipeline) as Grafana JSON, built from
    sinks/runwatch/sinks/grafana/panels.py with grafana-foundation-sdk."""
    from pathlib import Path

    from runwatch.sinks.grafana.generate import stale_files, write_dashboards

    if not database.isidentifier():
        fail(f"--database {database!r} is not a plain identifier")
    if check:
        if not Path(out_dir).is_dir():
            fail(
                f"no dashboards to check: {out_dir} is not a folder (run this in a runwatch checkout, or "
                "give --out)"
            )
        stale = stale_files(Path(out_dir), database)
        if stale:
            click.echo(
                f"out of date in {out_dir}: {', '.join(stale)} (run `runwatch grafana generate`)", err=True
            )
            sys.exit(EXIT_VERDICT)
        click.echo(f"{out_dir}: up to date")
        return
    for path in write_dashboards(Path(out_dir), database):
        click.echo(f"wrote {path}")


@grafana.command(cls=NeedsExtra, extras=["grafana"], without=["grafana-foundation-sdk"])
@click.option(
    "--url",
    envvar="RUNWATCH_GRAFANA_URL",
    required=True,
    help="Grafana's base URL, http(s)://host:3000[/prefix] [$RUNWATCH_GRAFANA_URL]",
)
@click.option(
    "--token",
    envvar="RUNWATCH_GRAFANA_TOKEN",
    help="a service account token (Admin: it creates a datasource) [$RUNWATCH_GRAFANA_TOKEN]",
)
@click.option(
    "--folder", "folder_title", default="runwatch", show_default=True, help="the dashboards' folder title"
)
@click.option("--folder-uid", help="the folder's uid [default: the title, slugged]")
@click.option(
    "--datasource-url",
    default=DEFAULT_DATASOURCE_URL,
    show_default=True,
    help=(
        "ClickHouse as Grafana reaches it: native://, clickhouses://, http:// or "
        "https://USER@HOST[:PORT][/DB]; USER a read-only user"
    ),
)
@click.option(
    "--datasource-password",
    envvar="RUNWATCH_CLICKHOUSE_READER_PASSWORD",
    help=(
        "that user's password, sent as secureJsonData "
        "[$RUNWATCH_CLICKHOUSE_READER_PASSWORD, as the provisioning file]"
    ),
)
@click.option(
    "--datasource-uid",
    default="runwatch-clickhouse",
    show_default=True,
    help="the datasource's uid (the dashboards' panels are wired to it)",
)
@click.option(
    "--datasource-name", default="runwatch ClickHouse", show_default=True, help="the datasource's name"
)
@click.option(
    "--tls-skip-verify", is_flag=True, help="the datasource skips verifying ClickHouse's TLS certificate"
)
@click.option(
    "--update-password",
    is_flag=True,
    help="send the password even when one is stored (Grafana never shows it, so it cannot be compared)",
)
@click.option(
    "--dashboards",
    "dashboards_dir",
    type=click.Path(file_okay=False, exists=True),
    help="a directory of dashboard JSON [default: deploy/grafana/dashboards]",
)
@click.option("--dry-run", is_flag=True, help="only read: say what would be created or updated")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="seconds per HTTP request")
def provision(
    url: str,
    token: str | None,
    folder_title: str,
    folder_uid: str | None,
    datasource_url: str,
    datasource_password: str | None,
    datasource_uid: str,
    datasource_name: str,
    tls_skip_verify: bool,
    update_password: bool,
    dashboards_dir: str | None,
    dry_run: bool,
    as_json: bool,
    timeout: float,
) -> None:
    """Create or update the folder, the ClickHouse datasource and the dashboards in the Grafana at --url
    through its HTTP API, idempotently: what already matches is left alone, so a second run only reads.

    Prints each object's outcome (created, updated, unchanged; with --dry-run: would create, would
    update). Exits 2 when Grafana cannot be reached, refuses the token (401/403) or answers nonsense."""
    from pathlib import Path

    from pydantic import ValidationError

    from runwatch.sinks.grafana import provision as prov

    try:
        datasource = prov.datasource_from_url(
            datasource_url,
            name=datasource_name,
            uid=datasource_uid,
            password=datasource_password,
            tls_skip_verify=tls_skip_verify,
        )
    except (ValueError, ValidationError) as exc:
        fail(f"--datasource-url: {exc}")
    try:
        dashboards = prov.load_dashboards(Path(dashboards_dir) if dashboards_dir else None)
        api = prov.connect(url, token, timeout=timeout)
        provisioner = prov.Provisioner(api, url, dry_run=dry_run, update_password=update_password)
        folder = folder_uid or prov.folder_uid(folder_title)
        outcomes = provisioner.run(folder_title, folder, datasource, dashboards)
        strays = provisioner.strays(folder, [str(d["uid"]) for d in dashboards])
    except prov.GrafanaUnreachable as exc:
        if not dry_run:
            fail(str(exc))
        # A dry run with no Grafana to compare with: what a run would send, compared with nothing.
        click.echo(f"note: {exc}: nothing compared", err=True)
        click.echo(f"would create or update  folder      {folder:<28} {folder_title}")
        click.echo(f"would create or update  datasource  {datasource_uid:<28} {datasource_name}")
        for d in dashboards:
            click.echo(f"would create or update  dashboard   {d['uid']!s:<28} {d.get('title', '')}")
        return
    except prov.ProvisionError as exc:
        fail(str(exc))
    counts = Counter(o.action for o in outcomes)
    if as_json:
        report = {
            "url": redacted(url),
            "dry_run": dry_run,
            "objects": [o.model_dump() for o in outcomes],
            "counts": dict(counts),
            "not_runwatch": [{"uid": u, "title": t} for u, t in strays],
        }
        print_json(report)
        return
    for o in outcomes:
        detail = f"  ({', '.join(o.changed)})" if o.changed else ""
        click.echo(f"{o.action:<13} {o.kind:<11} {o.uid:<28} {o.title}{detail}")
    for uid, title in strays:
        click.echo(f"note: dashboard {uid} ({title}) in folder {folder} is not one of runwatch's; left alone")
    shown: tuple[prov.Action, ...] = (
        ("would create", "would update", "unchanged") if dry_run else ("created", "updated", "unchanged")
    )
    click.echo(f"grafana {redacted(url)}: " + ", ".join(f"{counts[a]} {a}" for a in shown))
