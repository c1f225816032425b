"""The run-end check against the job's history: when a run ends, its summary against the earlier
runs of its baseline key and hardware fingerprint (``check.check_run``); outliers become one
``baseline_outliers`` finding whose evidence carries the table a notification shows.

Pure, like every detector: the monitor feeds it the run's events and anomalies, and the worker
hands it the history (the candidate summaries it loaded from ClickHouse at the run's start). With
no history handed (no ClickHouse, or none configured) it stays silent; ``unavailable`` says why, once.
"""

from __future__ import annotations

from typing import Any

from runwatch.contract.schema import Anomaly, RunEndEvent, TelemetryEvent
from runwatch.detectors.baselines.check import check_run
from runwatch.detectors.baselines.compare import BaselineConfig, MetricComparison
from runwatch.detectors.baselines.summary import RunSummarizer, RunSummary
from runwatch.detectors.findings import Finding

NAME = "baseline_outliers"


def comparison_row(c: MetricComparison) -> dict[str, Any]:
    """One metric of the table, as JSON (the finding's evidence, the alert's params)."""
    return {
        "metric": c.metric,
        "last": c.value,
        "median": c.median,
        "low": c.low,
        "high": c.high,
        "n": c.n,
        "verdict": c.verdict,
        "change": c.change,
    }


class RunEndBaselineCheck:
    """Summarises one run as it goes and judges it against its history when it ends."""

    def __init__(self, run_id: str, config: BaselineConfig):
        self.config = config
        self.summarizer = RunSummarizer(run_id, config.loss_every)
        self.candidates: list[RunSummary] | None = None
        self.unavailable: str | None = "no history was handed to the check"
        self.done = False

    def set_history(self, candidates: list[RunSummary] | None, unavailable: str | None = None) -> None:
        """The runs the worker loaded for this run's baseline key and fingerprint (None: it could not,
        for ``unavailable``)."""
        self.candidates = candidates
        self.unavailable = unavailable if candidates is None else None

    def observe(self, event: TelemetryEvent) -> None:
        self.summarizer.observe(event)

    def add_anomaly(self, anomaly: Anomaly) -> None:
        if anomaly.detector != NAME:
            self.summarizer.add_anomaly(anomaly)

    def summary(self) -> RunSummary:
        return self.summarizer.summary()

    def finish(self, end: RunEndEvent) -> list[Finding]:
        """The check, once, at the run's end: a ``baseline_outliers`` warning if any metric is an
        OUTLIER; nothing otherwise (insufficient history is no finding: the gate says so)."""
        if self.done or self.candidates is None or end.status != "completed":
            return []
        self.done = True
        run = self.summarizer.summary()
        report = check_run(run, self.candidates, self.config)
        bad = [c for c in report.comparisons if c.verdict == "OUTLIER"]
        if not bad:
            return []
        worst = max(bad, key=lambda c: abs(c.change or 0.0))
        names = ", ".join(c.metric for c in bad)
        message = (
            f"{len(bad)} metric(s) outside the {self.config.window_days:g}-day baseline of "
            f"{run.baseline_key}: {names} (worst {worst.metric} {worst.change:+.1%} vs the median of "
            f"{worst.n} runs)"
        )
        baseline = {
            "baseline_key": run.baseline_key,
            "fingerprint": run.fingerprint,
            "window_days": self.config.window_days,
            "git_sha": run.git_sha,
            "last_normal_sha": report.last_normal_sha,
            "last_normal_run": report.last_normal_run,
            "history_runs": report.history_size,
            "rows": [comparison_row(c) for c in bad],
        }
        return [
            Finding(
                detector=NAME,
                metric=worst.metric,
                step=None,
                severity="warning",
                message=message,
                value=worst.value,
                threshold=worst.high if worst.change and worst.change > 0 else worst.low,
                score=worst.change,
                evidence={"baseline": baseline},
            )
        ]
