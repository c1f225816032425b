"""replay / evaluate / calibrate on a small synthetic labelled corpus (pure logic, no broker)."""

from __future__ import annotations

import json
import math
import random
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from click.testing import CliRunner

from runwatch.cli.main import main
from runwatch.contract.schema import Anomaly, HeartbeatEvent, StepEvent
from runwatch.detectors.config import RunwatchConfig, load_config
from runwatch.detectors.offline.calibrate import calibrate
from runwatch.detectors.offline.evaluate import (
    Corpus,
    ScenarioLabel,
    evaluate_dir,
    score_scenario,
)
from runwatch.detectors.offline.replay import ReplayError, read_events, replay, replay_file

T0 = datetime(2026, 11, 21, 9, 0, tzinfo=UTC)
STEPS = 300


def run_events(name: str, seed: int, fault: str | None = None, onset: int = 200, noise: float = 0.05):
    rng = random.Random(seed)
    events = []
    for step in range(STEPS):
        loss = 2.0 * math.exp(-step / 400) * math.exp(rng.gauss(0, noise))
        grad = 1.0 * math.exp(rng.gauss(0, 2 * noise))
        if fault == "non_finite" and step >= onset:
            loss = grad = float("nan")
        if fault == "loss_spike" and step == onset:
            loss *= 40
        events.append(
            StepEvent(
                run_id=name, step=step, ts=T0 + timedelta(seconds=0.5 * step), loss=loss, grad_norm=grad
            )
        )
    return events


def write_corpus(directory, noisy_healthy: bool = False):
    labels = []
    specs = [("nan-1", "non_finite", "non_finite", 0), ("spike-1", "loss_spike", "loss_spike", 1)]
    specs += [(f"healthy-{i}", "healthy", None, 10 + i) for i in range(3)]
    for name, fault, detector, seed in specs:
        events = run_events(
            name,
            seed,
            None if fault == "healthy" else fault,
            noise=0.3 if noisy_healthy and fault == "healthy" else 0.05,
        )
        (directory / f"{name}.jsonl").write_text("".join(e.to_json().decode() + "\n" for e in events))
        labels.append(
            {
                "name": name,
                "fault": fault,
                "expected_detector": detector,
                "onset_step": None if fault == "healthy" else 200,
                "onset_ts": None if fault == "healthy" else (T0 + timedelta(seconds=100)).isoformat(),
                "steps": STEPS,
            }
        )
    (directory / "labels.json").write_text(json.dumps(labels))
    return directory


def test_replay_finds_a_nan_at_its_onset_with_event_time(tmp_path):
    path = tmp_path / "nan.jsonl"
    path.write_text("".join(e.to_json().decode() + "\n" for e in run_events("r", 0, "non_finite")))
    result = replay_file(path)
    first = result.anomalies[0]
    assert (first.detector, first.step, first.severity) == ("non_finite", 200, "warning")
    assert first.ts == T0 + timedelta(seconds=100)  # the event's time, not the wall clock
    # critical at the 3rd NaN; the recording has no checkpoint to restore, so the run is stopped
    assert [(d.kind, d.step) for d in result.decisions] == [("alert", 200), ("stop", 202)]
    assert result.steps == STEPS and result.runs == ["r"]


def test_replay_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = StepEvent(run_id="r", step=0, ts=T0).to_json().decode()
    path.write_text(
        good
        + "\n"
        + (
            '{"schema_version": 1, "event_id": "x", "rank": 0, "ts": '
            '"2024-01-01T00:00:00Z", "kind": "step", "run_id": "r"}\n'
        )
    )
    with pytest.raises(ReplayError, match=r"bad.jsonl:2: schema: step"):
        read_events(path)


class TickCounter:
    name = "tick_counter"

    def __init__(self):
        self.ticks = []

    def update(self, event, now):
        return []

    def tick(self, now):
        self.ticks.append(now)
        return []


def test_replay_ticks_on_event_time_across_a_gap(monkeypatch):
    from runwatch.detectors.engine import monitor

    counter = TickCounter()
    monkeypatch.setattr(
        monitor,
        "build_detectors",
        lambda config, names, progress: [counter] if names == monitor.RANK_VIEW else [],
    )
    events = [
        HeartbeatEvent(run_id="r", step=1, ts=T0),
        HeartbeatEvent(run_id="r", step=1, ts=T0 + timedelta(seconds=10)),
    ]
    replay(events, tick_every_s=2.0)
    assert counter.ticks == [T0 + timedelta(seconds=s) for s in (2, 4, 6, 8, 10)]


def test_evaluate_scores_recall_delay_and_false_alarms(tmp_path):
    evaluation = evaluate_dir(write_corpus(tmp_path))
    by_name = {s.name: s for s in evaluation.scenarios}
    assert by_name["nan-1"].correct_detector and by_name["nan-1"].delay_steps == 0
    assert by_name["nan-1"].delay_s == 0.0
    assert by_name["spike-1"].correct_detector and by_name["spike-1"].delay_steps == 0
    assert all(by_name[f"healthy-{i}"].false_alarms == 0 for i in range(3))
    summary = evaluation.summary
    assert summary["recall"] == 1.0 and summary["false_alarms_per_10k_healthy_steps"] == 0
    assert summary["median_delay_steps"] == 0 and summary["healthy_steps"] == 3 * STEPS
    assert set(evaluation.to_json()) == {"scenarios", "summary"}


def test_evaluate_counts_a_wrong_detector_as_a_miss(tmp_path):
    write_corpus(tmp_path)
    labels = json.loads((tmp_path / "labels.json").read_text())
    labels[1]["expected_detector"] = "grad_norm_spike"  # the loss spike is not a grad-norm spike
    (tmp_path / "labels.json").write_text(json.dumps(labels))
    spike = {s.name: s for s in evaluate_dir(tmp_path).scenarios}["spike-1"]
    assert spike.detected and not spike.correct_detector and spike.found_by == ["loss_spike"]


def test_calibrate_raises_thresholds_until_noisy_healthy_runs_are_quiet(tmp_path):
    corpus = Corpus(write_corpus(tmp_path, noisy_healthy=True))
    config, proposals = calibrate(corpus, target_false_alarms=0.0)
    by_detector = {p.detector: p for p in proposals}
    loss = by_detector["loss_spike"]
    assert loss.target_met and loss.false_alarms_per_10k == 0
    assert config.detectors.loss_spike.z_threshold == loss.proposed
    # the proposal is the most sensitive grid value meeting the target: one step down does not
    assert all(rate > 0 for value, rate in loss.tried[:-1])
    assert loss.faults_caught == 1 and loss.faults_labelled == 1
    RunwatchConfig.model_validate(config.model_dump())


def test_cli_replay_evaluate_calibrate(tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus")
    runner = CliRunner()
    out = runner.invoke(main, ["evaluate", str(corpus), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert {"name", "fault", "detected", "correct_detector", "delay_steps", "delay_s", "false_alarms"} <= set(
        data["scenarios"][0]
    )
    assert {"recall", "false_alarms_per_10k_healthy_steps", "median_delay_steps"} <= set(data["summary"])

    out = runner.invoke(main, ["replay", str(corpus / "nan-1.jsonl"), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["anomalies"][0]["step"] == 200

    written = tmp_path / "calibrated.yaml"
    out = runner.invoke(main, ["calibrate", str(corpus), "--target-false-alarms", "1", "--out", str(written)])
    assert out.exit_code == 0, out.output
    assert load_config(written) == RunwatchConfig.model_validate(yaml.safe_load(written.read_text()))

    out = runner.invoke(main, ["evaluate", str(tmp_path / "nowhere")])
    assert out.exit_code != 0


def test_calibrate_warns_when_the_corpus_cannot_resolve_the_target(tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus_dir = write_corpus(tmp_path / "corpus")
    out = CliRunner().invoke(
        main, ["calibrate", str(corpus_dir), "--target-false-alarms", "1", "--out", str(tmp_path / "c.yaml")]
    )
    assert out.exit_code == 0, out.output
    # 3 healthy runs of 300 steps: one alarm is already 11.1 per 10k steps
    assert "11.1 per 10k" in out.output
    assert "caution" in (tmp_path / "c.yaml").read_text().splitlines()[1]


def _throughput_finding(step: int, cause: str | None) -> Anomaly:
    evidence = {"onset_step": 150} if cause is None else {"onset_step": 150, "cause": cause}
    return Anomaly(
        anomaly_id=f"a{step}-{cause}",
        run_id="r",
        step=step,
        detector="throughput_drift",
        metric="step_time_s",
        severity="warning",
        message="step time rose",
        evidence=evidence,
        ts=T0 + timedelta(seconds=step),
    )


def test_evaluate_counts_a_throughput_finding_with_the_wrong_cause_as_a_miss():
    """A label's ``cause`` (issue 37: on a saturated host "unknown", never the run) is matched against the
    finding's ``evidence["cause"]``: the right detector blaming the wrong cause has not found the fault."""
    label = ScenarioLabel(
        name="noisy_neighbours",
        fault="throughput_drift",
        expected_detector="throughput_drift",
        onset_step=150,
        cause="unknown",
    )
    blamed = score_scenario(label, [_throughput_finding(171, "run")], STEPS)
    assert blamed.detected and not blamed.correct_detector and blamed.found_by == ["throughput_drift"]
    no_cause = score_scenario(label, [_throughput_finding(171, None)], STEPS)
    assert not no_cause.correct_detector  # a finding that judged no cause does not meet the label either
    found = score_scenario(
        label, [_throughput_finding(165, "run"), _throughput_finding(171, "unknown")], STEPS
    )
    assert found.correct_detector and found.delay_steps == 21  # the first finding with the right cause
    unlabelled = label.model_copy(update={"cause": None})
    assert score_scenario(unlabelled, [_throughput_finding(165, "run")], STEPS).correct_detector
