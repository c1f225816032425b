"""``runwatch baseline check`` (the CI gate) and ``runwatch baseline scan`` (change points over a job's
history), reading run summaries from ClickHouse."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from runwatch.cli.failure import DSN_HELP, fail
from runwatch.cli.needs import NeedsExtra
from runwatch.cli.options import cli_config
from runwatch.cli.output import print_json

if TYPE_CHECKING:
    from runwatch.detectors.baselines.changepoints import LevelChange
    from runwatch.detectors.baselines.check import BaselineReport
    from runwatch.detectors.baselines.compare import BaselineConfig

CONFIG_HELP = (
    "runwatch YAML whose `baseline` section applies (window, min runs, band, per-metric tolerances "
    "as `runwatch calibrate` proposes them)"
)
GIT_REPO_HELP = "a clone of the code the runs ran: show the commits between the runs (git log A..B)"


def _repo(path: str | None) -> Path | None:
    """The checked ``--git-repo`` clone, or None; exits 2 when it is not a git repository."""
    from runwatch.cli.gitlog import GitError, check_repo

    if path is None:
        return None
    try:
        return check_repo(path)
    except GitError as exc:
        fail(f"--git-repo: {exc}")


def _change_row(c: LevelChange, repo: Path | None) -> dict[str, Any]:
    """One change point as printed (``--json``'s ``change_points`` entry), its commit's time and
    subject filled in from ``repo`` when that clone has the commit."""
    from runwatch.cli.gitlog import commit_info

    row: dict[str, Any] = {
        "metric": c.metric,
        "kind": c.kind,
        "run_id": c.run_id,
        "git_sha": c.git_sha,
        "commit_time": c.commit_time.isoformat() if c.commit_time else None,
        "subject": None,
        "previous_run_id": c.previous_run_id,
        "previous_sha": c.previous_sha,
        "fingerprint": c.fingerprint,
        "started_at": c.started_at.isoformat() if c.started_at else None,
        "mean_before": c.mean_before,
        "mean_after": c.mean_after,
        "relative_change": c.relative_change,
        "pvalue": c.pvalue,
        "runs_scanned": c.runs_scanned,
    }
    if repo is not None and c.git_sha:
        info = commit_info(repo, c.git_sha)
        if info is not None:
            row["commit_time"] = row["commit_time"] or info[0].isoformat()
            row["subject"] = info[1]
    return row


def _print_change_points(baseline_key: str, runs: int, rows: list[dict[str, Any]]) -> None:
    """The scan as text: a count line, then each metric's change points."""
    click.echo(f"{baseline_key}: {runs} run(s), {len(rows)} change point(s)")
    for metric in dict.fromkeys(r["metric"] for r in rows):
        click.echo(f"{metric}:")
        for r in (r for r in rows if r["metric"] == metric):
            sha = (r["git_sha"] or "unknown")[:12]
            when = f" committed {r['commit_time']}" if r["commit_time"] else ""
            subject = f' "{r["subject"]}"' if r["subject"] else ""
            click.echo(
                f"  {r['kind']:<11} {r['relative_change']:+.1%} "
                f"({r['mean_before']:.4g} -> {r['mean_after']:.4g}, p={r['pvalue']:.3f}) "
                f"first at run {r['run_id']}, commit {sha}{subject}{when}"
            )


def _baseline_report(run_id: str, dsn: str | None, config: BaselineConfig) -> BaselineReport:
    """The run's verdict: through the local page when a stack owns the store, else from the store."""
    from runwatch.cli.startup import open_sink
    from runwatch.detectors.baselines.check import BaselineReport
    from runwatch.sinks.clickhouse import default_dsn
    from runwatch.sinks.page import PageError, find_page
    from runwatch.sinks.summaries import RunNotFound, baseline_report

    page = find_page(dsn or default_dsn())
    if page is not None:
        try:
            answer = page.baseline(run_id, config.model_dump_json())
        except (OSError, PageError) as exc:
            fail(f"{exc} (through the local page at {page.url})")
        computed = ("exit_code", "insufficient_history")  # properties, in the JSON only
        return BaselineReport.model_validate({k: v for k, v in answer.items() if k not in computed})
    sink = open_sink(dsn)
    try:
        return baseline_report(sink, run_id, config)
    except RunNotFound:
        fail(f"unknown run {run_id!r}: no summary and no telemetry in ClickHouse at {sink.dsn}")
    except Exception as exc:  # noqa: BLE001 - ClickHouse failing mid-way
        fail(f"reading ClickHouse at {sink.dsn} failed: {type(exc).__name__}: {exc}")
    finally:
        sink.close()


@click.group()
def baseline() -> None:
    """Runs against the history of their job: the CI gate and the change-point scan."""


@baseline.command(cls=NeedsExtra, extras=["sink"])
@click.argument("run_id")
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help=DSN_HELP)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help=CONFIG_HELP)
@click.option(
    "--window-days", type=float, help="the history: runs this many days before [config's; default 30]"
)
@click.option("--min-runs", type=int, help="fewer is 'insufficient_history' [config's; default 5]")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option(
    "--markdown", "as_markdown", is_flag=True, help="print a Markdown report (for a pull-request comment)"
)
@click.option("--git-repo", type=click.Path(), help=GIT_REPO_HELP)
def check(
    run_id: str,
    dsn: str | None,
    config_path: str | None,
    window_days: float | None,
    min_runs: int | None,
    as_json: bool,
    as_markdown: bool,
    git_repo: str | None,
) -> None:
    """Compare RUN_ID's summary with its job's history (same baseline key and hardware).

    Exits 1 when any metric is an OUTLIER, 0 otherwise (insufficient history included: the report
    says so), 2 when it cannot judge (unknown run, ClickHouse unreachable, not a git repository)."""
    from pydantic import ValidationError

    from runwatch.cli.gitlog import GitError, commit_range
    from runwatch.detectors.baselines.check import render_markdown, render_table
    from runwatch.detectors.baselines.compare import BaselineConfig

    if as_json and as_markdown:
        fail("--json and --markdown exclude each other")
    base = cli_config(config_path).baseline
    overrides = {k: v for k, v in (("window_days", window_days), ("min_runs", min_runs)) if v is not None}
    try:
        config = BaselineConfig.model_validate({**base.model_dump(), **overrides})
    except ValidationError as exc:
        fail(f"bad option: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}")
    repo = _repo(git_repo)
    report = _baseline_report(run_id, dsn, config)
    commits = None
    if repo is not None:
        try:
            commits = commit_range(repo, report.last_normal_sha, report.git_sha)
        except GitError as exc:
            fail(f"--git-repo: {exc}")
    if as_json:
        print_json(
            {
                **report.model_dump(mode="json"),
                "commit_range": commits.model_dump(mode="json") if commits is not None else None,
            }
        )
    elif as_markdown:
        click.echo(render_markdown(report, commits), nl=False)
    else:
        click.echo(render_table(report, commits), nl=False)
    sys.exit(report.exit_code)


@baseline.command(cls=NeedsExtra, extras=["sink"])
@click.option("--baseline-key", required=True, help="the job whose history to scan")
@click.option("--fingerprint", help="one hardware fingerprint (default: each, separately)")
@click.option(
    "--metric", "metrics", multiple=True, help="only this metric (repeatable; default: every judged one)"
)
@click.option("--dsn", envvar="RUNWATCH_CLICKHOUSE_DSN", help=DSN_HELP)
@click.option(
    "--max-pvalue",
    type=click.FloatRange(0, 1, min_open=True),
    default=0.01,
    show_default=True,
    help="the permutation test's significance level",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="the permutations' seed (a scan is reproducible)"
)
@click.option("--git-repo", type=click.Path(), help="fill in commit times and subjects from this clone")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help=CONFIG_HELP)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def scan(
    baseline_key: str,
    fingerprint: str | None,
    metrics: tuple[str, ...],
    dsn: str | None,
    max_pvalue: float,
    seed: int,
    git_repo: str | None,
    config_path: str | None,
    as_json: bool,
) -> None:
    """List the change points of each metric over a job's history (E-divisive means), each with the
    first run and commit at the new level. Runs on other hardware and before a declared new
    baseline are separate histories."""
    from runwatch.cli.startup import open_sink
    from runwatch.detectors.baselines.changepoints import scan_history

    repo = _repo(git_repo)
    sink = open_sink(dsn)
    try:
        summaries = sink.baselines.for_key(baseline_key, fingerprint)
    except Exception as exc:  # noqa: BLE001
        fail(f"reading ClickHouse at {sink.dsn} failed: {type(exc).__name__}: {exc}")
    finally:
        sink.close()
    if not summaries:
        fail(
            f"no run summaries for baseline key {baseline_key!r}"
            + (f" on {fingerprint}" if fingerprint else "")
        )
    changes = scan_history(
        summaries, cli_config(config_path).baseline, metrics=metrics or None, max_pvalue=max_pvalue, seed=seed
    )
    rows = [_change_row(c, repo) for c in changes]
    if as_json:
        print_json(
            {
                "baseline_key": baseline_key,
                "fingerprint": fingerprint,
                "runs": len(summaries),
                "change_points": rows,
            }
        )
        return
    _print_change_points(baseline_key, len(summaries), rows)
