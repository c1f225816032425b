"""Run summaries built from what ClickHouse holds: a run's stored telemetry and anomalies through
``RunSummarizer`` (the same code the worker runs), written to ``run_summaries``.

Used by the sink consumer (when a run's ``run_end`` is stored, and for runs whose events stopped:
status ``died``) and by ``runwatch ingest``. Idempotent: summarising a run again rewrites its row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from runwatch.contract.schema import TelemetryEvent
from runwatch.detectors.baselines.compare import GOODPUT_METRIC
from runwatch.detectors.baselines.summary import RunSummarizer, RunSummary, Status
from runwatch.sinks.clickhouse import ClickHouseSink

if TYPE_CHECKING:
    from runwatch.detectors.baselines.check import BaselineReport
    from runwatch.detectors.baselines.compare import BaselineConfig

log = logging.getLogger(__name__)

# Anomalies that are about the summary itself (the run-end check against the history): counting
# them in the summary they were made from would feed a run's verdict back into its own figures.
SUMMARY_DETECTORS = frozenset({"baseline_outliers"})


class RunNotFound(LookupError):
    """No telemetry is stored for the run."""


def summarize_stored_run(
    sink: ClickHouseSink, run_id: str, status_if_not_ended: Status = "died", loss_every: int = 100
) -> RunSummary:
    """Summarise ``run_id`` from its stored events and anomalies, write the row, return it.
    ``status_if_not_ended``: the status of a run with no ``run_end`` stored. Raises ``RunNotFound``
    when the run has no stored telemetry."""
    events = sink.runs.stored_events(run_id)
    if not events:
        raise RunNotFound(f"no telemetry stored for run {run_id!r}")
    return summarize_run(sink, run_id, events, status_if_not_ended, loss_every)


def summarize_run(
    sink: ClickHouseSink,
    run_id: str,
    events: Iterable[TelemetryEvent],
    status_if_not_ended: Status = "died",
    loss_every: int = 100,
) -> RunSummary:
    """Summarise ``run_id`` from ``events`` (its events, in time order; other runs' are ignored)
    and its stored anomalies, write the row, return it. ``runwatch ingest`` hands in the events it
    read: a recording older than the telemetry table's TTL (90 days) is not kept there, but its
    summary is."""
    summarizer = RunSummarizer(run_id, loss_every)
    for event in events:
        if event.run_id == run_id:
            summarizer.observe(event)
    for anomaly in sink.runs.stored_anomalies(run_id):
        if anomaly.detector not in SUMMARY_DETECTORS:
            summarizer.add_anomaly(anomaly)
    summary = summarizer.summary(status_if_not_ended)
    _add_goodput(sink, summary)
    sink.writer.write_summaries([summary])
    return summary


def _add_goodput(sink: ClickHouseSink, summary: RunSummary) -> None:
    """Compute and store the run's goodput (issue 39) and put it in its summary as ``goodput_pct`` (what
    ``runwatch baseline check`` compares). A run whose telemetry is not stored (an ingest of a recording
    past the table's retention) has none; a failure here is logged and never costs the summary."""
    from runwatch.sinks.goodput import compute_goodput, write_goodput

    try:
        goodput = compute_goodput(sink, summary.run_id)
        if goodput is None:
            return
        write_goodput(sink, goodput)
    except Exception as exc:  # noqa: BLE001 - the summary stands without it
        log.warning("runwatch sink: the goodput of run %s could not be computed (%r)", summary.run_id, exc)
        return
    if goodput.goodput is not None:
        summary.metrics[GOODPUT_METRIC] = 100.0 * goodput.goodput


class SummaryUpkeep:
    """What the sink consumer does for run summaries: summarise the runs whose ``run_end`` was just
    stored, and every ``interval_s`` the runs whose events stopped ``died_after_s`` ago (as
    ``died``). A failure is logged and never raised: the run is tried again at the next interval.
    An ended run is summarised once more at the next interval too: anomalies come on their own
    topic and may be stored after its ``run_end``."""

    def __init__(
        self,
        sink: ClickHouseSink,
        *,
        died_after_s: float = 600.0,
        interval_s: float = 30.0,
        loss_every: int = 100,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self.sink = sink
        self.died_after_s = died_after_s
        self.interval_s = interval_s
        self.loss_every = loss_every
        self._clock = clock
        self._now = now
        self._next_sweep = clock() + interval_s
        self._again: set[str] = set()  # ended runs to summarise at the next sweep (failed, or late anomalies)
        self.summarized = 0
        self.errors = 0

    def _summarize(self, run_id: str, status_if_not_ended: Status) -> bool:
        try:
            summarize_stored_run(self.sink, run_id, status_if_not_ended, self.loss_every)
        except Exception as exc:  # noqa: BLE001 - a summary must never stop the sink
            self.errors += 1
            log.warning(
                "runwatch sink: summarising run %s failed (%r); retrying at the next interval", run_id, exc
            )
            return False
        self.summarized += 1
        return True

    def ended(self, run_ids: set[str]) -> None:
        """Runs whose ``run_end`` was just stored."""
        for run_id in sorted(run_ids):
            self._summarize(run_id, "running")
            self._again.add(run_id)

    def tick(self) -> None:
        """Called often (after every poll); sweeps once per ``interval_s``."""
        if self._clock() < self._next_sweep:
            return
        self._next_sweep = self._clock() + self.interval_s
        again, self._again = self._again, set()
        for run_id in sorted(again):
            if not self._summarize(run_id, "running"):
                self._again.add(run_id)
        try:
            stopped = self.sink.runs.to_summarize(self._now(), self.died_after_s)
        except Exception as exc:  # noqa: BLE001 - ClickHouse away: the next sweep tries again
            self.errors += 1
            log.warning("runwatch sink: looking for runs to summarise failed (%r)", exc)
            return
        for run_id in stopped:
            self._summarize(run_id, "died")


def baseline_report(sink: ClickHouseSink, run_id: str, config: BaselineConfig) -> BaselineReport:
    """``runwatch baseline check``'s verdict on ``run_id``: its summary (summarised from its telemetry
    now when the sink has not yet, as ``running``) against its job's history. Raises ``RunNotFound``."""
    from runwatch.detectors.baselines.check import check_run

    run = sink.baselines.summary(run_id)
    if run is None:  # not summarised yet (the sink summarises at run end): do it from its telemetry
        run = summarize_stored_run(sink, run_id, "running", config.loss_every)
    candidates: list[RunSummary] = []
    if run.baseline_key is not None and run.started_at is not None:
        candidates = sink.baselines.candidates(
            run.baseline_key, run.fingerprint, run.started_at, config.window_days
        )
    return check_run(run, candidates, config)
