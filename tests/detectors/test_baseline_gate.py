"""The run-end check against history, driven through the monitor as the worker drives it: a run
that ends slower than its job's history gets a ``baseline_outliers`` warning and an alert whose
params carry the outlier table, which the remediator turns into an "outlier alert (30-day)"."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import Action, RunEndEvent, RunStartEvent, StepEvent
from runwatch.detectors.baselines.summary import RunSummarizer, RunSummary
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import RunMonitor
from runwatch.sinks.remediate.notifications import slack_payload

T0 = datetime(2026, 10, 1, tzinfo=UTC)
KEY = "jobs/gate"


def run_events(
    run_id: str,
    start: datetime,
    step_time: float,
    seed: int,
    steps: int = 120,
    status: str = "completed",
    sha: str = "a" * 40,
) -> list:
    rng = random.Random(seed)
    events: list = [
        RunStartEvent(run_id=run_id, ts=start, baseline_key=KEY, git_sha=sha, tags={"hardware": "cpu-test"})
    ]
    t = start
    for step in range(steps):
        dt = step_time * (1 + rng.gauss(0, 0.01))
        t += timedelta(seconds=dt)
        events.append(
            StepEvent(
                run_id=run_id,
                step=step,
                ts=t,
                loss=2.0 - step / steps + rng.gauss(0, 0.01),
                step_time_s=dt,
                samples_per_s=64 / dt,
            )
        )
    events.append(RunEndEvent(run_id=run_id, ts=t + timedelta(seconds=1), status=status))
    return events


def history(n: int = 8) -> list[RunSummary]:
    out = []
    for i in range(n):
        summarizer = RunSummarizer(f"past-{i}")
        for event in run_events(f"past-{i}", T0 + timedelta(days=i), 0.2, seed=i, sha=f"{i:040x}"):
            summarizer.observe(event)
        out.append(summarizer.summary())
    return out


def drive(monitor: RunMonitor, events: list) -> tuple[list, list]:
    anomalies, decisions = [], []
    for event in events:
        out = monitor.observe(event)
        anomalies += out.anomalies
        decisions += out.decisions
    return anomalies, decisions


def test_a_slower_run_ends_with_an_outlier_alert_that_names_the_metric_and_the_last_normal_commit():
    monitor = RunMonitor("slow", RunwatchConfig())
    past = history()
    monitor.set_history(past)
    anomalies, decisions = drive(
        monitor, run_events("slow", T0 + timedelta(days=10), 0.25, seed=99, sha="b" * 40)
    )
    found = [a for a in anomalies if a.detector == "baseline_outliers"]
    assert len(found) == 1
    rows = {row["metric"]: row for row in found[0].evidence["baseline"]["rows"]}
    assert "step_time_median_s" in rows and rows["step_time_median_s"]["verdict"] == "OUTLIER"
    assert rows["step_time_median_s"]["change"] > 0.2
    assert found[0].evidence["baseline"]["last_normal_sha"] == past[-1].git_sha
    alert = next(d for d in decisions if d.anomaly_ids == [found[0].anomaly_id])
    assert alert.kind == "alert" and alert.params["baseline"]["baseline_key"] == KEY
    action = Action(
        action_id=alert.action_id,
        run_id="slow",
        kind="alert",
        reason=alert.reason,
        params=alert.params,
        issued_at=T0,
        expires_at=T0 + timedelta(minutes=2),
    )
    text = slack_payload(action)["text"]
    assert "outlier alert (30-day)" in text and KEY in text
    line = next(line for line in text.splitlines() if "step_time_median_s" in line)
    assert "OUTLIER" in line and "30-day median 0.2" in line


def test_a_run_like_its_history_is_silent():
    monitor = RunMonitor("same", RunwatchConfig())
    monitor.set_history(history())
    anomalies, _ = drive(monitor, run_events("same", T0 + timedelta(days=10), 0.2, seed=42))
    assert [a for a in anomalies if a.detector == "baseline_outliers"] == []


def test_no_history_handed_or_too_little_history_or_a_failed_run_is_silent():
    slow = run_events("slow", T0 + timedelta(days=10), 0.3, seed=1)
    for candidates, events in (
        (None, slow),
        (history(3), slow),
        (history(), run_events("slow", T0 + timedelta(days=10), 0.3, seed=1, status="failed")),
    ):
        monitor = RunMonitor("slow", RunwatchConfig())
        if candidates is not None:
            monitor.set_history(candidates)
        anomalies, _ = drive(monitor, events)
        assert [a for a in anomalies if a.detector == "baseline_outliers"] == []
    monitor = RunMonitor("x", RunwatchConfig())
    assert "no history" in (monitor.baseline.unavailable or "")
    monitor.set_history(None, "ClickHouse unreachable")
    assert monitor.baseline.unavailable == "ClickHouse unreachable"
