"""Offline evaluation of the detectors on a labelled corpus (``runwatch scenarios generate``).

Per scenario: was the fault found, by the detector that should find it, naming the right
module / category / kind / phase / split / cause (``MATCHED_ATTRIBUTES``) where the label has one,
how late (steps and seconds after the onset), and how many false alarms (any finding before the
onset; any finding at all in a healthy run). Findings of severity ``info`` are not alarms.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from runwatch.contract.schema import Anomaly, TelemetryEvent
from runwatch.detectors.baselines.band import (
    BaselineBand,
    band_from_runs,
    bucket_steps_for,
    run_record,
    select_baseline_runs,
)
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.offline.replay import ReplayError, read_events, replay

LABELS_FILE = "labels.json"
# Which evidence key of a finding must equal which label field, where the label has it.
MATCHED_ATTRIBUTES = ("module", "category", "kind", "phase", "split", "cause")


class ScenarioLabel(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    fault: str  # "healthy" for a run without a fault
    expected_detector: str | None = None
    onset_step: int | None = None
    onset_ts: datetime | None = None
    module: str | None = None
    category: str | None = None
    kind: str | None = None
    phase: str | None = None
    split: str | None = None  # the eval split at fault (a validation leak)
    cause: str | None = None  # what a throughput finding must blame: run | unknown | contention
    steps: int | None = None

    @property
    def healthy(self) -> bool:
        return self.fault == "healthy"


@dataclass
class ScenarioResult:
    name: str
    fault: str
    expected_detector: str | None
    detected: bool  # some finding at or after the onset
    correct_detector: bool  # the expected detector found it, naming the labelled module/category/kind
    delay_steps: int | None
    delay_s: float | None
    false_alarms: int
    steps: int
    found_by: list[str] = field(default_factory=list)  # detectors with findings after the onset
    first_false_alarm: str | None = None


@dataclass
class Evaluation:
    scenarios: list[ScenarioResult]
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"scenarios": [asdict(s) for s in self.scenarios], "summary": self.summary}


class Corpus:
    """A directory of recordings and their labels, decoded once (calibration replays it many times)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        labels_path = self.directory / LABELS_FILE
        try:
            raw = json.loads(labels_path.read_text())
        except OSError as exc:
            raise ReplayError(f"cannot read {labels_path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ReplayError(f"{labels_path} is not JSON: {exc}") from None
        try:
            self.labels = [ScenarioLabel.model_validate(item) for item in raw]
        except (ValidationError, TypeError) as exc:
            raise ReplayError(f"{labels_path}: not a list of scenario labels: {exc}") from None
        self.events: dict[str, list[TelemetryEvent]] = {
            label.name: read_events(self.directory / f"{label.name}.jsonl") for label in self.labels
        }


def _is_alarm(anomaly: Anomaly) -> bool:
    return anomaly.severity != "info"


def _after_onset(anomaly: Anomaly, label: ScenarioLabel) -> bool:
    if label.onset_step is not None and anomaly.step is not None:
        return anomaly.step >= label.onset_step
    return label.onset_ts is not None and anomaly.ts >= label.onset_ts


def _matches(anomaly: Anomaly, label: ScenarioLabel) -> bool:
    if anomaly.detector != label.expected_detector:
        return False
    return all(
        getattr(label, key) is None or anomaly.evidence.get(key) == getattr(label, key)
        for key in MATCHED_ATTRIBUTES
    )


def score_scenario(label: ScenarioLabel, anomalies: list[Anomaly], steps: int) -> ScenarioResult:
    alarms = [a for a in anomalies if _is_alarm(a)]
    if label.healthy:
        false = alarms
        after: list[Anomaly] = []
    else:
        false = [a for a in alarms if not _after_onset(a, label)]
        after = [a for a in alarms if _after_onset(a, label)]
    hits = [a for a in after if _matches(a, label)]
    first = min(hits, key=lambda a: a.ts) if hits else None
    delay_steps = delay_s = None
    if first is not None:
        if first.step is not None and label.onset_step is not None:
            delay_steps = first.step - label.onset_step
        if label.onset_ts is not None:
            delay_s = round((first.ts - label.onset_ts).total_seconds(), 3)
    return ScenarioResult(
        name=label.name,
        fault=label.fault,
        expected_detector=label.expected_detector,
        detected=bool(after),
        correct_detector=first is not None,
        delay_steps=delay_steps,
        delay_s=delay_s,
        false_alarms=len(false),
        steps=steps,
        found_by=sorted({a.detector for a in after}),
        first_false_alarm=f"{false[0].detector} at step {false[0].step}: {false[0].message}"
        if false
        else None,
    )


def corpus_bands(corpus: Corpus, config: RunwatchConfig) -> dict[str, BaselineBand | str]:
    """Per run id, the band of the corpus runs of its baseline key (and hardware) that started before
    it, as the worker would load it from ClickHouse; or why it has none. Labels play no part."""
    section = config.detectors.baseline_trajectory
    records = {name: run_record(events) for name, events in corpus.events.items()}
    events_of = {records[name].run_id: events for name, events in corpus.events.items()}
    bands: dict[str, BaselineBand | str] = {}
    for record in records.values():
        if record.baseline_key is None:
            bands[record.run_id] = "the run has no baseline_key: no comparison with history"
            continue
        history = select_baseline_runs(
            record, records.values(), window_days=config.baseline.window_days, max_runs=section.max_runs
        )
        if not history:
            bands[record.run_id] = (
                f"no earlier completed run of baseline {record.baseline_key!r} on this hardware "
                "in the window: no comparison with history"
            )
            continue
        runs = [events_of[h.run_id] for h in history]
        last = max((getattr(e, "step", 0) or 0 for run in runs for e in run), default=0)
        bands[record.run_id] = band_from_runs(
            runs,
            baseline_key=record.baseline_key,
            fingerprint=record.fingerprint,
            bucket_steps=bucket_steps_for(last, section.max_buckets),
        )
    return bands


def evaluate_corpus(corpus: Corpus, config: RunwatchConfig | None = None) -> Evaluation:
    config = config or RunwatchConfig()
    bands = corpus_bands(corpus, config) if config.detectors.baseline_trajectory.enabled else None
    results = []
    for label in corpus.labels:
        outcome = replay(corpus.events[label.name], config, bands=bands)
        results.append(score_scenario(label, outcome.anomalies, outcome.steps))
    return Evaluation(results, summarize(results))


def summarize(results: list[ScenarioResult]) -> dict[str, Any]:
    faults = [r for r in results if r.fault != "healthy"]
    healthy = [r for r in results if r.fault == "healthy"]
    healthy_steps = sum(r.steps for r in healthy)
    delays = [r.delay_steps for r in faults if r.correct_detector and r.delay_steps is not None]
    return {
        "fault_scenarios": len(faults),
        "healthy_scenarios": len(healthy),
        "recall": round(sum(r.correct_detector for r in faults) / len(faults), 4) if faults else None,
        "detected_any": round(sum(r.detected for r in faults) / len(faults), 4) if faults else None,
        "false_alarms_per_10k_healthy_steps": (
            round(10_000 * sum(r.false_alarms for r in healthy) / healthy_steps, 3) if healthy_steps else None
        ),
        "false_alarms_before_onset": sum(r.false_alarms for r in faults),
        "median_delay_steps": statistics.median(delays) if delays else None,
        "healthy_steps": healthy_steps,
    }


def evaluate_dir(directory: str | Path, config: RunwatchConfig | None = None) -> Evaluation:
    return evaluate_corpus(Corpus(directory), config)
