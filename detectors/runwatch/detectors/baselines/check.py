"""The CI gate's judgement of one run against its job's history, and its reports.

``select_history`` picks, from the candidate summaries the sink loaded, the runs a run is compared
with; ``check_run`` compares it (``compare.compare_run``) and names the last normal run, whose commit
starts the commit range a regression is looked for in; ``render_table`` / ``render_markdown`` /
``BaselineReport.model_dump`` are its plain, pull-request and JSON forms. Pure: the candidates and
the commit range (from ``git log``) are handed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Protocol, TypeVar

from pydantic import BaseModel, Field, computed_field

from runwatch.detectors.baselines.compare import (
    GOODPUT_METRIC,
    BaselineConfig,
    MetricComparison,
    compare_run,
    is_valid,
    metric_spec,
)
from runwatch.detectors.baselines.summary import RunSummary

EXIT_NORMAL = 0
EXIT_OUTLIER = 1
EXIT_ERROR = 2


class RunIdentity(Protocol):
    """What choosing a run's history reads of a run: a ``RunSummary``, or a band's ``RunRecord``."""

    @property
    def run_id(self) -> str: ...
    @property
    def baseline_key(self) -> str | None: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def started_at(self) -> datetime | None: ...
    @property
    def status(self) -> str: ...
    @property
    def new_baseline(self) -> bool: ...


R = TypeVar("R", bound=RunIdentity)


def _same_baseline(run: RunIdentity, other: RunIdentity) -> bool:
    return other.baseline_key == run.baseline_key and other.fingerprint == run.fingerprint


def baseline_start(run: R, candidates: Iterable[R]) -> R | None:
    """The run that declared the baseline ``run`` belongs to: the latest ``new_baseline`` run of the
    same key and fingerprint that started before it (whatever its status: the declaration is what
    counts), or ``run`` itself when it declares one; None when none did."""
    if run.new_baseline:
        return run
    declared = [
        c
        for c in candidates
        if c.new_baseline
        and c.run_id != run.run_id
        and _same_baseline(run, c)
        and c.started_at is not None
        and run.started_at is not None
        and c.started_at <= run.started_at
    ]
    return max(declared, key=lambda c: (c.started_at, c.run_id), default=None)


def select_history(run: R, candidates: Iterable[R], config: BaselineConfig) -> list[R]:
    """The runs ``run`` is compared with, oldest first: the same baseline key and hardware
    fingerprint, completed, started before it and within ``config.window_days``, not itself, and
    not before the latest declared new baseline (a run that declares one has no history). A run
    with no baseline key or no start time has no history. The one rule for the gate, the run-end
    check and the in-flight band (which takes the newest of these runs)."""
    candidates = list(candidates)
    if run.baseline_key is None or run.started_at is None:
        return []
    since = run.started_at - timedelta(days=config.window_days)
    declared = baseline_start(run, candidates)
    if declared is run:
        return []
    if declared is not None and declared.started_at is not None:
        since = max(since, declared.started_at)
    history = [
        c
        for c in candidates
        if c.run_id != run.run_id
        and _same_baseline(run, c)
        and c.status == "completed"
        and c.started_at is not None
        and since <= c.started_at < run.started_at
    ]
    history.sort(key=lambda c: (c.started_at, c.run_id))
    return history


class BaselineReport(BaseModel):
    """``check_run``'s answer: the run, its comparisons and where a regression came in."""

    run_id: str
    baseline_key: str | None
    fingerprint: str
    git_sha: str | None
    started_at: datetime | None
    status: str
    window_days: float
    min_runs: int
    history_size: int = Field(description="runs in the history (each metric's own n counts its valid values)")
    baseline_declared_by: str | None = Field(
        default=None, description="the run that declared the baseline this history starts at"
    )
    comparisons: list[MetricComparison]
    outliers: list[str] = Field(description="the metrics judged OUTLIER, in table order")
    last_normal_run: str | None = None
    last_normal_sha: str | None = None
    last_normal_started_at: datetime | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def exit_code(self) -> int:
        """The gate's: 1 when any metric is an OUTLIER, else 0."""
        return EXIT_OUTLIER if self.outliers else EXIT_NORMAL

    @computed_field  # type: ignore[prop-decorator]
    @property
    def insufficient_history(self) -> bool:
        """True when the history holds fewer than ``min_runs`` runs: no metric can be judged."""
        return self.history_size < self.min_runs


def _outside(value: float | None, comparison: MetricComparison, config: BaselineConfig) -> bool:
    """Whether a history run's ``value`` would itself be an OUTLIER against ``comparison``'s band."""
    if comparison.metric == GOODPUT_METRIC:  # judged in points: below the band's low end
        return value is None or comparison.low is None or not value >= comparison.low
    spec = metric_spec(comparison.metric)
    if spec is None or value is None or not is_valid(value, spec) or comparison.median is None:
        return True  # no evidence it was normal
    if comparison.low is None or comparison.high is None:
        return False
    scale = abs(comparison.median)
    change = (value - comparison.median) / scale if scale > 0 else 0.0
    worse_by = change if spec.direction == "lower_is_better" else -change
    worse = value > comparison.high if spec.direction == "lower_is_better" else value < comparison.low
    return worse and worse_by > config.min_change.get(comparison.metric, spec.min_change)


def last_normal(
    history: Sequence[RunSummary], comparisons: Sequence[MetricComparison], config: BaselineConfig
) -> RunSummary | None:
    """The most recent history run whose own values were inside the band on every metric this run
    is an outlier on (with no outlier: simply the most recent history run).

    Not just the most recent run: once a regression has landed, the runs after it are in the
    history too, outside the band (the median still sits at the old level); the range from the
    latest of them would leave out the commit that regressed. Starting at the last run that was
    still normal on those metrics keeps that commit inside ``git log A..B``."""
    bad = [c for c in comparisons if c.verdict == "OUTLIER"]
    for run in reversed(history):
        if not any(_outside(run.metrics.get(c.metric), c, config) for c in bad):
            return run
    return None


def check_run(run: RunSummary, candidates: Iterable[RunSummary], config: BaselineConfig) -> BaselineReport:
    """``run`` against its history among ``candidates`` (``select_history``): every judged metric's
    verdict, the outliers, and the last normal run with its commit."""
    candidates = list(candidates)
    history = select_history(run, candidates, config)
    comparisons = compare_run(run.metrics, [h.metrics for h in history], config)
    normal = last_normal(history, comparisons, config)
    declared = baseline_start(run, candidates)
    return BaselineReport(
        run_id=run.run_id,
        baseline_key=run.baseline_key,
        fingerprint=run.fingerprint,
        git_sha=run.git_sha,
        started_at=run.started_at,
        status=run.status,
        window_days=config.window_days,
        min_runs=config.min_runs,
        history_size=len(history),
        baseline_declared_by=declared.run_id if declared is not None else None,
        comparisons=comparisons,
        outliers=[c.metric for c in comparisons if c.verdict == "OUTLIER"],
        last_normal_run=normal.run_id if normal else None,
        last_normal_sha=normal.git_sha if normal else None,
        last_normal_started_at=normal.started_at if normal else None,
    )


# -- the commit range (found by the caller with git) and the renderers -------------------------------


class Commit(BaseModel):
    sha: str
    subject: str


class CommitRange(BaseModel):
    """``git log --oneline A..B`` between the last normal run's commit and this run's."""

    from_sha: str | None
    to_sha: str | None
    commits: list[Commit] = Field(default_factory=list)
    note: str | None = Field(
        default=None, description="why there is no list (a sha unknown to the repository...)"
    )


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    return f"{value:.4g}"


def _band(c: MetricComparison) -> str:
    return "-" if c.low is None or c.high is None else f"{_num(c.low)}..{_num(c.high)}"


def _spread(c: MetricComparison) -> str:
    return "-" if c.spread is None else f"{c.spread:.1%}"


def _change(c: MetricComparison) -> str:
    return "-" if c.change is None else f"{c.change:+.1%}"


def table_rows(report: BaselineReport) -> list[list[str]]:
    """The table's cells: metric, last, baseline median, band, n, verdict, change, spread."""
    return [
        [c.metric, _num(c.value), _num(c.median), _band(c), str(c.n), c.verdict, _change(c), _spread(c)]
        for c in report.comparisons
    ]


TABLE_HEADER = ["metric", "last", "baseline median", "band", "n", "verdict", "change", "spread"]


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "unknown"


def _headline(report: BaselineReport, code: str = "") -> str:
    where = f"{report.baseline_key or '(no baseline key)'} on fingerprint {report.fingerprint}"
    if report.outliers:
        verdict = f"{len(report.outliers)} OUTLIER metric(s): {', '.join(report.outliers)}"
    elif report.insufficient_history:
        verdict = (
            f"insufficient history ({report.history_size} run(s) in the {report.window_days:g}-day window, "
            f"{report.min_runs} needed)"
        )
    else:
        verdict = "every metric normal"
    return f"run {code}{report.run_id}{code} ({where}), {report.history_size} run(s) of history: {verdict}"


def _range_lines(report: BaselineReport, commits: CommitRange | None) -> list[str]:
    lines = [
        f"this run's commit: {_short(report.git_sha)}; last normal run: "
        f"{report.last_normal_run or 'none'} at {_short(report.last_normal_sha)}"
    ]
    if report.baseline_declared_by:
        lines.append(f"baseline declared by run {report.baseline_declared_by}")
    if commits is not None:
        lines.append(f"commits {_short(commits.from_sha)}..{_short(commits.to_sha)}:")
        if commits.note:
            lines.append(f"  ({commits.note})")
        lines.extend(f"  {c.sha[:12]} {c.subject}" for c in commits.commits)
        if not commits.commits and not commits.note:
            lines.append("  (none)")
    return lines


def render_table(report: BaselineReport, commits: CommitRange | None = None) -> str:
    """The plain-text report: a headline, one aligned row per metric, the commit range."""
    rows = [TABLE_HEADER, *table_rows(report)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_HEADER))]
    lines = [_headline(report), ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("")
    lines += _range_lines(report, commits)
    return "\n".join(lines) + "\n"


def render_markdown(report: BaselineReport, commits: CommitRange | None = None) -> str:
    """The report as a pull-request comment: a headline, a Markdown table, the commit range."""
    icon = {
        "OUTLIER": "🔴 OUTLIER",
        "INVALID": "⚠️ INVALID",
        "insufficient_history": "⚪ insufficient history",
        "normal": "✅ normal",
    }
    title = "outliers" if report.outliers else "no outliers"
    lines = [f"### runwatch baseline check: {title}", "", _headline(report, code="`"), ""]
    lines.append("| " + " | ".join(TABLE_HEADER) + " |")
    lines.append(
        "|" + "|".join("---" if i == 0 or i == 5 else "---:" for i in range(len(TABLE_HEADER))) + "|"
    )
    for c, cells in zip(report.comparisons, table_rows(report), strict=True):
        cells[0] = f"`{cells[0]}`"
        cells[5] = icon.get(c.verdict, c.verdict)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"This run's commit: `{_short(report.git_sha)}`; last normal run: "
        f"`{report.last_normal_run or 'none'}` at `{_short(report.last_normal_sha)}`."
    )
    if report.baseline_declared_by:
        lines.append(f"Baseline declared by run `{report.baseline_declared_by}`.")
    if commits is not None:
        lines.append("")
        lines.append(
            f"<details><summary>Commits {_short(commits.from_sha)}..{_short(commits.to_sha)} "
            f"({len(commits.commits)})</summary>"
        )
        lines.append("")
        if commits.note:
            lines.append(f"_{commits.note}_")
        lines.extend(f"- `{c.sha[:12]}` {c.subject}" for c in commits.commits)
        lines.append("")
        lines.append("</details>")
    return "\n".join(lines) + "\n"
