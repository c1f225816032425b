"""What a run report shows, read from ClickHouse once: the run's curves, findings and actions, and its
baseline verdicts and band. Everything after this (panels, HTML) is pure and works on ``ReportData``."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import orjson

from runwatch.sinks.rows import as_utc

if TYPE_CHECKING:
    from runwatch.detectors.baselines.band import BaselineBand
    from runwatch.detectors.baselines.check import BaselineReport
    from runwatch.detectors.baselines.compare import BaselineConfig
    from runwatch.detectors.baselines.summary import RunSummary
    from runwatch.sinks.clickhouse import ClickHouseSink
    from runwatch.sinks.goodput import Goodput
    from runwatch.sinks.hosts import LemonHost

TOP_MODULES = 8  # module lines in the "top modules" panel
HEATMAP_MODULES = 40
HEATMAP_COLUMNS = 200  # step buckets of the module heatmap


class UnknownRun(LookupError):
    """ClickHouse holds no telemetry for the run."""


@dataclass
class ReportData:
    """One run as the report draws it (rows as the sink's ``report_*`` reads return them)."""

    run_id: str
    info: dict[str, Any]
    run_start: dict[str, Any]
    run_end: dict[str, Any] | None
    steps: list[dict[str, Any]]
    rank_step_times: list[dict[str, Any]]
    modules: list[dict[str, Any]]
    heatmap: list[dict[str, Any]]
    heatmap_bucket_steps: int
    evals: list[dict[str, Any]]
    anomalies: list[dict[str, Any]]
    actions: list[dict[str, Any]]
    baseline: BaselineReport | None = None
    band: BaselineBand | None = None
    baseline_note: str = ""  # why there is no verdict or band, said plainly
    generated_at: datetime | None = None
    notes: list[str] = field(default_factory=list)
    # Issue 39: where the run's wall time went, and the hosts of its job that keep failing
    goodput: Goodput | None = None
    job: str | None = None
    lemon_hosts: list[LemonHost] = field(default_factory=list)


def _json(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def run_summary(sink: ClickHouseSink, run_id: str, loss_every: int) -> RunSummary | None:
    """The run's stored summary, else one made now from its stored events (not written back: a report
    only reads); None without events."""
    from runwatch.detectors.baselines.summary import RunSummarizer
    from runwatch.sinks.summaries import SUMMARY_DETECTORS

    stored = sink.baselines.summary(run_id)
    if stored is not None:
        return stored
    events = sink.runs.stored_events(run_id)
    if not events:
        return None
    summarizer = RunSummarizer(run_id, loss_every)
    for event in events:
        summarizer.observe(event)
    for anomaly in sink.runs.stored_anomalies(run_id):
        if anomaly.detector not in SUMMARY_DETECTORS:
            summarizer.add_anomaly(anomaly)
    return summarizer.summary("running")


def _baseline(
    sink: ClickHouseSink, run_id: str, config: BaselineConfig
) -> tuple[BaselineReport | None, BaselineBand | None, str]:
    """The run's verdicts against its history (as ``runwatch baseline check`` judges it) and the per-step
    band of that history, with a note when either is missing."""
    from runwatch.detectors.baselines.check import check_run

    summary = run_summary(sink, run_id, config.loss_every)
    if summary is None:
        return None, None, "no summary could be made of this run"
    if summary.baseline_key is None or summary.started_at is None:
        return (
            None,
            None,
            (
                "no baseline history: this run has no baseline key (set `baseline_key` in its "
                "run_start), so there is nothing to compare it with"
            ),
        )
    candidates = sink.baselines.candidates(
        summary.baseline_key, summary.fingerprint, summary.started_at, config.window_days
    )
    report = check_run(summary, candidates, config)
    band = sink.baselines.band(
        summary.baseline_key, summary.fingerprint, summary.started_at, config.window_days, exclude_run=run_id
    )
    note = ""
    if report.history_size == 0:
        note = (
            f"no baseline history: no earlier run of {summary.baseline_key!r} on this hardware "
            f"({summary.fingerprint}) in the {config.window_days:g} days before it"
        )
    elif report.insufficient_history:
        note = (
            f"insufficient history: {report.history_size} earlier run(s) of {summary.baseline_key!r}, "
            f"{report.min_runs} needed for a verdict"
        )
    return report, band, note


def _goodput_and_hosts(
    sink: ClickHouseSink, run_id: str, job: str | None, notes: list[str]
) -> tuple[Goodput | None, list[LemonHost]]:
    """The run's goodput (computed now from what is stored: a report only reads) and its job's lemon
    hosts; what cannot be read is said in ``notes``, never fatal to the report."""
    from runwatch.sinks.goodput import compute_goodput
    from runwatch.sinks.hosts import lemon_hosts

    goodput, hosts = None, []
    try:
        goodput = compute_goodput(sink, run_id)
    except Exception as exc:  # noqa: BLE001 - the report stands without it
        notes.append(f"the goodput could not be computed: {type(exc).__name__}")
    if job:
        try:
            hosts = lemon_hosts(sink, job=job)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"the job's failing hosts could not be read: {type(exc).__name__}")
    return goodput, hosts


def collect(
    sink: ClickHouseSink, run_id: str, config: BaselineConfig | None = None, now: datetime | None = None
) -> ReportData:
    """Everything the report of ``run_id`` shows; raises ``UnknownRun`` when nothing is stored for it."""
    from runwatch.detectors.baselines.compare import BaselineConfig

    config = config or BaselineConfig()
    info = sink.report.run_info(run_id)
    if info is None:
        raise UnknownRun(f"unknown run {run_id!r}: no telemetry for it in ClickHouse at {sink.dsn}")
    steps = sink.report.steps(run_id)
    last_step = max((int(s["step"]) for s in steps if s["step"] is not None), default=0)
    bucket = max(1, -(-last_step // HEATMAP_COLUMNS))
    baseline, band, note = _baseline(sink, run_id, config)
    run_start = _json(info["run_start"]) or {}
    job = run_start.get("job_id") or None
    notes: list[str] = []
    goodput, hosts = _goodput_and_hosts(sink, run_id, job, notes)
    return ReportData(
        run_id=run_id,
        info=info,
        run_start=run_start,
        run_end=_json(info["run_end"]),
        steps=steps,
        rank_step_times=sink.report.rank_step_times(run_id) if info["ranks"] > 1 else [],
        modules=sink.report.module_grad_norms(run_id, TOP_MODULES),
        heatmap=sink.report.module_heatmap(run_id, bucket, HEATMAP_MODULES),
        heatmap_bucket_steps=bucket,
        evals=sink.report.evals(run_id),
        anomalies=sink.report.anomalies(run_id),
        actions=sink.report.actions(run_id),
        baseline=baseline,
        band=band,
        baseline_note=note,
        generated_at=as_utc(now) if now else None,
        notes=notes,
        goodput=goodput,
        job=job,
        lemon_hosts=hosts,
    )
