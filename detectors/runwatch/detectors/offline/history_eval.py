"""Scoring the comparison with history on a history corpus (``runwatch scenarios history``).

Every run's summary is built from its recorded events (``RunSummarizer``, as the worker and the
ingest build it); then, run by run in start order, the CI gate's own pure check (``check.check_run``)
judges it against the runs before it, and the change-point scan (``changepoints.scan_history``) runs
once over the whole history, as ``runwatch baseline scan`` does. Per labelled regression:

* found: the first run at the regressing commit has an OUTLIER on a labelled metric (the gate exits 1);
  a regression labelled ``in_flight`` also counts as found when the in-flight band detector
  (``baseline_trajectory``, replayed with the band of the run's baseline runs) flags its first run;
* commit_named_correctly: the scan puts a regression-kind change point of a labelled metric at the
  regressing commit; commit_range_contains: the gate's range (last normal run's commit .. this run's)
  contains it;
* false alarms: OUTLIER verdicts on runs at benign commits (noise, fixes, the hardware move, the
  declared new baseline and the runs after it) and at the first commit.

No ClickHouse: the same pure code the gate runs after loading the summaries from it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from runwatch.contract.schema import TelemetryEvent
from runwatch.detectors.baselines.changepoints import LevelChange, baseline_segments, scan_history
from runwatch.detectors.baselines.check import BaselineReport, check_run
from runwatch.detectors.baselines.compare import (
    BaselineConfig,
    MetricSpec,
    is_valid,
    metric_spec,
)
from runwatch.detectors.baselines.summary import RunSummarizer, RunSummary
from runwatch.detectors.offline.replay import ReplayError, read_events
from runwatch.detectors.rolling_quantile import MAD_TO_SIGMA

LABELS_FILE = "labels.json"
HISTORY_KIND = "history"
IN_FLIGHT_DETECTOR = "baseline_trajectory"


class RunLabel(BaseModel):
    model_config = ConfigDict(extra="allow")

    run_id: str
    file: str
    commit: str
    commit_name: str
    day: int
    fingerprint: str
    new_baseline: bool = False


class RegressionLabel(BaseModel):
    model_config = ConfigDict(extra="allow")

    commit: str
    name: str
    metrics: list[str]
    description: str = ""
    first_run: str
    in_flight: bool = False


class BenignLabel(BaseModel):
    model_config = ConfigDict(extra="allow")

    commit: str
    name: str
    kind: str
    description: str = ""


class HistoryLabels(BaseModel):
    model_config = ConfigDict(extra="allow")

    kind: Literal["history"]
    baseline_key: str
    loss_every: int = 100
    window_days: float = 30.0
    runs: list[RunLabel]
    regressions: list[RegressionLabel]
    benign: list[BenignLabel]


def is_history_corpus(directory: str | Path) -> bool:
    """Whether ``directory``'s labels.json says ``kind: history``."""
    try:
        raw = json.loads((Path(directory) / LABELS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("kind") == HISTORY_KIND


class HistoryCorpus:
    """A history corpus' labels and every run's events, decoded once."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        path = self.directory / LABELS_FILE
        try:
            self.labels = HistoryLabels.model_validate_json(path.read_text())
        except OSError as exc:
            raise ReplayError(f"cannot read {path}: {exc.strerror}") from None
        except ValidationError as exc:
            raise ReplayError(f"{path}: not the labels of a history corpus: {exc}") from None
        self.events: dict[str, list[TelemetryEvent]] = {
            run.run_id: read_events(self.directory / run.file) for run in self.labels.runs
        }

    def config(self, base: BaselineConfig | None = None) -> BaselineConfig:
        """``base`` (default: the built-in one) with the corpus' ``loss_every`` and window."""
        base = base or BaselineConfig()
        return base.model_copy(
            update={"loss_every": self.labels.loss_every, "window_days": self.labels.window_days}
        )


def summarize(events: Sequence[TelemetryEvent], run_id: str, loss_every: int) -> RunSummary:
    summarizer = RunSummarizer(run_id, loss_every)
    for event in events:
        summarizer.observe(event)
    return summarizer.summary(status_if_not_ended="died")


def gate_every_run(summaries: Sequence[RunSummary], config: BaselineConfig) -> dict[str, BaselineReport]:
    """Each run's gate report against the runs that started before it, in start order."""
    ordered = sorted(summaries, key=lambda s: (s.started_at is None, s.started_at, s.run_id))
    return {run.run_id: check_run(run, ordered[:i], config) for i, run in enumerate(ordered)}


@dataclass
class RegressionResult:
    commit: str
    name: str
    description: str
    metrics: list[str]
    first_run: str
    found: bool
    found_metrics: list[str]  # labelled metrics the gate called OUTLIER on the first run
    other_outliers: list[str]  # unlabelled metrics it also called OUTLIER there
    gate_exit_code: int
    history_runs: int
    last_normal_run: str | None
    last_normal_sha: str | None
    commit_range_contains: bool
    commit_named_correctly: bool
    named_by: list[str]  # labelled metrics whose scan names the commit
    scan_named: dict[
        str, str | None
    ]  # per labelled metric: the first regression change point's commit at or after
    in_flight: bool = False
    in_flight_status: str | None = None  # found / not found / pending (no in-flight detector to replay)
    in_flight_finding: str | None = None
    later_runs_flagged: int = (
        0  # the other runs at the regressing commit with an outlier on a labelled metric
    )
    later_runs: int = 0


@dataclass
class FalseAlarm:
    run_id: str
    commit_name: str
    kind: str
    metrics: list[str]


@dataclass
class HistoryEvaluation:
    regressions: list[RegressionResult]
    false_alarms: list[FalseAlarm]
    insufficient_history: list[str]
    scan_false_alarms: list[dict[str, Any]]
    runs: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": HISTORY_KIND,
            "regressions": [asdict(r) for r in self.regressions],
            "false_alarms": [asdict(f) for f in self.false_alarms],
            "insufficient_history": self.insufficient_history,
            "scan_false_alarms": self.scan_false_alarms,
            "runs": self.runs,
            "summary": self.summary,
        }


def _commit_index(labels: HistoryLabels) -> dict[str, int]:
    order: dict[str, int] = {}
    for run in labels.runs:
        order.setdefault(run.commit, len(order))
    return order


def _range_contains(order: dict[str, int], from_sha: str | None, to_sha: str | None, sha: str) -> bool:
    """Whether ``git log from..to`` holds ``sha`` on the corpus' linear history."""
    if to_sha not in order or sha not in order:
        return False
    start = order[from_sha] if from_sha in order else -1
    return start < order[sha] <= order[to_sha]


def in_flight_check(corpus: HistoryCorpus, run_id: str) -> tuple[str, str | None]:
    """Replays ``run_id`` with the in-flight band of its baseline runs: ("found" | "not found", the
    first finding's message) or ("pending", why) when no in-flight detector can be replayed."""
    try:
        from runwatch.detectors.baseline_trajectory import BaselineTrajectoryConfig
        from runwatch.detectors.baselines.band import (
            band_from_runs,
            bucket_steps_for,
            run_record,
            select_baseline_runs,
        )
        from runwatch.detectors.offline.replay import replay
    except ImportError as exc:  # the in-flight detector is not there
        return "pending", f"no in-flight detector to replay: {exc}"
    band_config = BaselineTrajectoryConfig()
    records = {rid: run_record(events) for rid, events in corpus.events.items()}
    run = records[run_id]
    chosen = select_baseline_runs(
        run, list(records.values()), window_days=corpus.labels.window_days, max_runs=band_config.max_runs
    )
    if not chosen:
        return "not found", "no baseline runs for the band"
    events = corpus.events[run_id]
    last_step = max((getattr(e, "step", 0) or 0 for e in events), default=0)
    band = band_from_runs(
        [corpus.events[r.run_id] for r in chosen],
        baseline_key=run.baseline_key or "",
        fingerprint=run.fingerprint,
        bucket_steps=bucket_steps_for(last_step, band_config.max_buckets),
    )
    result = replay(events, bands={run_id: band})
    hits = [a for a in result.anomalies if a.detector == IN_FLIGHT_DETECTOR and a.severity != "info"]
    if not hits:
        return "not found", None
    first = min(hits, key=lambda a: a.ts)
    return "found", f"step {first.step}: {first.message}"


def evaluate_history(
    corpus: HistoryCorpus, base: BaselineConfig | None = None, *, in_flight: bool = True
) -> HistoryEvaluation:
    """Score the gate, the change-point scan and (for in-flight labels) the band detector on ``corpus``."""
    labels = corpus.labels
    config = corpus.config(base)
    summaries = [summarize(corpus.events[r.run_id], r.run_id, config.loss_every) for r in labels.runs]
    by_id = {s.run_id: s for s in summaries}
    reports = gate_every_run(summaries, config)
    run_labels = {r.run_id: r for r in labels.runs}
    order = _commit_index(labels)
    labelled_metrics = sorted({m for r in labels.regressions for m in r.metrics})
    changes = scan_history(summaries, config, metrics=labelled_metrics) if labelled_metrics else []

    results = [
        _score_regression(reg, reports, changes, order, labels, corpus, in_flight)
        for reg in labels.regressions
    ]
    regressing = {r.commit for r in labels.regressions}
    kinds = {b.commit: b.kind for b in labels.benign}
    false_alarms = []
    for run in labels.runs:
        report = reports[run.run_id]
        if run.commit not in regressing and report.outliers:
            false_alarms.append(
                FalseAlarm(
                    run.run_id, run.commit_name, kinds.get(run.commit, "initial"), list(report.outliers)
                )
            )
    insufficient = [r.run_id for r in labels.runs if reports[r.run_id].insufficient_history]
    scan_false = [
        {
            "metric": c.metric,
            "run_id": c.run_id,
            "commit_name": run_labels[c.run_id].commit_name,
            "relative_change": round(c.relative_change, 4),
        }
        for c in changes
        if c.kind == "regression" and c.git_sha not in regressing
    ]
    runs = [
        {
            "run_id": r.run_id,
            "day": r.day,
            "fingerprint": r.fingerprint,
            "commit_name": r.commit_name,
            "history": reports[r.run_id].history_size,
            "exit_code": reports[r.run_id].exit_code,
            "insufficient_history": reports[r.run_id].insufficient_history,
            "outliers": list(reports[r.run_id].outliers),
            "last_normal_run": reports[r.run_id].last_normal_run,
        }
        for r in labels.runs
    ]
    summary = _summary(results, false_alarms, insufficient, scan_false, labels, by_id)
    return HistoryEvaluation(results, false_alarms, insufficient, scan_false, runs, summary)


def _score_regression(
    reg: RegressionLabel,
    reports: dict[str, BaselineReport],
    changes: Sequence[LevelChange],
    order: dict[str, int],
    labels: HistoryLabels,
    corpus: HistoryCorpus,
    in_flight: bool,
) -> RegressionResult:
    report = reports[reg.first_run]
    found_metrics = [m for m in report.outliers if m in reg.metrics]
    named_by = _named_by(reg, changes)
    scan_named = _scan_named(reg, changes, report.started_at)
    later = [r.run_id for r in labels.runs if r.commit == reg.commit and r.run_id != reg.first_run]
    result = RegressionResult(
        commit=reg.commit,
        name=reg.name,
        description=reg.description,
        metrics=list(reg.metrics),
        first_run=reg.first_run,
        found=bool(found_metrics),
        found_metrics=found_metrics,
        other_outliers=[m for m in report.outliers if m not in reg.metrics],
        gate_exit_code=report.exit_code,
        history_runs=report.history_size,
        last_normal_run=report.last_normal_run,
        last_normal_sha=report.last_normal_sha,
        commit_range_contains=_range_contains(order, report.last_normal_sha, report.git_sha, reg.commit),
        commit_named_correctly=bool(named_by),
        named_by=named_by,
        scan_named=scan_named,
        in_flight=reg.in_flight,
        later_runs_flagged=sum(any(m in reg.metrics for m in reports[r].outliers) for r in later),
        later_runs=len(later),
    )
    if reg.in_flight:
        _score_in_flight(result, corpus, in_flight)
    return result


def _named_by(reg: RegressionLabel, changes: Sequence[LevelChange]) -> list[str]:
    """The labelled metrics the scan puts a regression-kind change point of at the regressing commit."""
    return sorted(
        {
            c.metric
            for c in changes
            if c.metric in reg.metrics and c.kind == "regression" and c.git_sha == reg.commit
        }
    )


def _scan_named(
    reg: RegressionLabel, changes: Sequence[LevelChange], first_start: datetime | None
) -> dict[str, str | None]:
    """Per labelled metric, the commit of the scan's first regression-kind change point that starts at
    or after the regression's first run (``first_start``); None where there is none."""
    scan_named: dict[str, str | None] = {}
    for metric in reg.metrics:
        after = [
            c
            for c in changes
            if c.metric == metric
            and c.kind == "regression"
            and first_start is not None
            and c.started_at is not None
            and c.started_at >= first_start
        ]
        first = min(after, key=lambda c: (c.started_at, c.run_id), default=None)
        scan_named[metric] = first.git_sha if first is not None else None
    return scan_named


def _score_in_flight(result: RegressionResult, corpus: HistoryCorpus, in_flight: bool) -> None:
    """An in-flight regression: whether the band detector flags its first run (replayed only when
    ``in_flight`` asks for it), which also counts as found."""
    if in_flight:
        status, finding = in_flight_check(corpus, result.first_run)
    else:
        status, finding = "pending", "in-flight replay not asked for"
    result.in_flight_status, result.in_flight_finding = status, finding
    result.found = result.found or status == "found"


def _summary(
    results: list[RegressionResult],
    false_alarms: list[FalseAlarm],
    insufficient: list[str],
    scan_false: list[dict[str, Any]],
    labels: HistoryLabels,
    by_id: dict[str, RunSummary],
) -> dict[str, Any]:
    starts = [s.started_at for s in by_id.values() if s.started_at is not None]
    in_flight = [r for r in results if r.in_flight]
    return {
        "runs": len(labels.runs),
        "days": (max(starts) - min(starts)).days if starts else 0,
        "fingerprints": len({r.fingerprint for r in labels.runs}),
        "regressions": len(results),
        "regressions_found": sum(r.found for r in results),
        "regressions_found_by_gate": sum(bool(r.found_metrics) for r in results),
        "commits_named_correctly": sum(r.commit_named_correctly for r in results),
        "commit_ranges_correct": sum(r.commit_range_contains for r in results),
        "false_alarms": len(false_alarms),
        "false_alarm_metrics": sum(len(f.metrics) for f in false_alarms),
        "benign_runs": sum(1 for r in labels.runs if r.commit not in {x.commit for x in results}),
        "insufficient_history_runs": len(insufficient),
        "scan_false_alarms": len(scan_false),
        "in_flight": {r.name: r.in_flight_status for r in in_flight},
    }


def evaluate_history_dir(
    directory: str | Path, base: BaselineConfig | None = None, *, in_flight: bool = True
) -> HistoryEvaluation:
    return evaluate_history(HistoryCorpus(directory), base, in_flight=in_flight)


# -- tolerances from the history's own spread (runwatch calibrate DIR on a history corpus) ---------------

TOLERANCE_FLOOR = 0.01  # a metric that never varies (emulated memory) still gets 1%: not a hair trigger
TOLERANCE_STEP = 0.005  # proposals are rounded up to this


@dataclass
class ToleranceProposal:
    metric: str
    default: float  # the built-in minimum relative change
    proposed: float
    spread: float  # the largest robust spread (1.4826 MAD / |median|) over the fingerprints' normal runs
    max_deviation: float  # the largest |value - median| / |median| of a normal run, over the fingerprints
    runs: int  # normal runs with a valid value
    per_fingerprint: dict[str, dict[str, float]]  # segment -> its n, spread, max deviation


def propose_tolerances(
    corpus: HistoryCorpus, k: float = 3.0, base: BaselineConfig | None = None
) -> list[ToleranceProposal]:
    """Per judged metric, a minimum relative change from the run-to-run spread of the normal runs (those
    at commits no label calls a regression), per hardware fingerprint and declared baseline: the larger
    of ``k`` x the largest robust spread and the largest deviation of a normal run from its median (a
    metric whose reruns fall into two modes has a small MAD and a large deviation), rounded up to
    ``TOLERANCE_STEP``, never below ``TOLERANCE_FLOOR``."""
    config = corpus.config(base)
    regressing = {r.commit for r in corpus.labels.regressions}
    normal = [
        summarize(corpus.events[r.run_id], r.run_id, config.loss_every)
        for r in corpus.labels.runs
        if r.commit not in regressing
    ]
    segments = [s for s in baseline_segments(normal) if len(s) >= config.min_runs]
    names = sorted({m for s in normal for m in s.metrics})
    out = []
    for metric in names:
        spec = metric_spec(metric)
        if spec is None:
            continue
        per: dict[str, dict[str, float]] = {}
        for segment in segments:
            figures = _segment_spread(segment, metric, spec, config.min_runs)
            if figures is not None:
                label = (
                    f"{segment[0].fingerprint_parts.get('hardware', segment[0].fingerprint)} "
                    f"from {segment[0].run_id}"
                )
                per[label] = figures
        if per:
            out.append(_proposal(metric, spec, per, k))
    return out


def _segment_spread(
    segment: Sequence[RunSummary], metric: str, spec: MetricSpec, min_runs: int
) -> dict[str, float] | None:
    """One segment's normal runs' figures for ``metric``: how many have a valid value, the robust spread
    (1.4826 MAD / |median|) and the largest |value - median| / |median|; None with fewer than
    ``min_runs`` valid values or a median of 0."""
    values = [float(v) for s in segment if (v := s.metrics.get(metric)) is not None and is_valid(v, spec)]
    if len(values) < min_runs:
        return None
    median = statistics.median(values)
    if median == 0:
        return None
    sigma = MAD_TO_SIGMA * statistics.median(abs(v - median) for v in values)
    return {
        "runs": len(values),
        "spread": round(sigma / abs(median), 5),
        "max_deviation": round(max(abs(v - median) for v in values) / abs(median), 5),
    }


def _proposal(metric: str, spec: MetricSpec, per: dict[str, dict[str, float]], k: float) -> ToleranceProposal:
    """The proposed tolerance of ``metric`` from its segments' figures ``per`` (from
    :func:`_segment_spread`; see :func:`propose_tolerances`)."""
    spread = max(p["spread"] for p in per.values())
    deviation = max(p["max_deviation"] for p in per.values())
    proposed = max(TOLERANCE_FLOOR, math.ceil(max(k * spread, deviation) / TOLERANCE_STEP) * TOLERANCE_STEP)
    return ToleranceProposal(
        metric,
        spec.min_change,
        round(proposed, 4),
        spread,
        deviation,
        int(sum(p["runs"] for p in per.values())),
        per,
    )


def tolerances_yaml(proposals: Sequence[ToleranceProposal], k: float, directory: str | Path) -> str:
    """The proposals as a runwatch YAML (its ``baseline.min_change``), the figures as comments."""
    import yaml

    lines = [
        f"# runwatch calibrate {directory}: per-metric minimum relative change = max({TOLERANCE_FLOOR:g}, "
        f"{k:g} x the largest robust spread, the largest deviation) of the normal runs per fingerprint",
        "# metric: default -> proposed (spread, largest deviation of a normal run, normal runs)",
    ]
    for p in proposals:
        lines.append(
            f"# {p.metric}: {p.default:g} -> {p.proposed:g} (spread {p.spread:.2%}, "
            f"max deviation {p.max_deviation:.2%}, {p.runs} runs)"
        )
    body = yaml.safe_dump(
        {"baseline": {"min_change": {p.metric: p.proposed for p in proposals}}}, sort_keys=False
    )
    return "\n".join(lines) + "\n" + body
