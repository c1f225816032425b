"""Thresholds from data: per detector, the most sensitive setting that the healthy runs tolerate.

"Without knowing the distribution of values for a metric, tolerance selection is mostly
guesswork." Each detector has one sensitivity knob (its main threshold). For each, the
healthy recordings are replayed with only that detector on, over a grid of knob values
around the default; the proposal is the most sensitive value whose false alarms per
10,000 healthy steps stay at or under the target. Fault recordings, where present, report
what that value still catches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import yaml
from pydantic import BaseModel, ValidationError

from runwatch.detectors import registry
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.offline.evaluate import Corpus, score_scenario
from runwatch.detectors.offline.replay import replay

# detector -> its sensitivity knob; a larger value is always less sensitive.
# Each detector's main sensitivity knob, as it declares it (detectors/runwatch/detectors/registry.py).
SENSITIVITY_KNOBS: dict[str, str] = {s.name: s.knob for s in registry.specs() if s.knob is not None}
GRID = (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)  # multiples of the default


@dataclass
class KnobProposal:
    detector: str
    knob: str
    default: float
    proposed: float
    false_alarms_per_10k: float
    target_met: bool
    faults_caught: int | None  # fault scenarios labelled for this detector that it still finds
    faults_labelled: int
    tried: list[tuple[float, float]]  # (value, false alarms per 10k) over the grid


def _with_knob(section: BaseModel, knob: str, value: float) -> BaseModel | None:
    data = section.model_dump()
    data[knob] = value
    if "critical_z" in data and knob == "z_threshold":
        data["critical_z"] = max(data["critical_z"], 2 * value)  # keep critical above the threshold
    try:
        return type(section).model_validate(data)
    except ValidationError:
        return None  # outside the knob's valid range


def _only(config: RunwatchConfig, detector: str, section: BaseModel) -> RunwatchConfig:
    sections = {
        name: getattr(config.detectors, name).model_copy(update={"enabled": name == detector})
        for name in type(config.detectors).model_fields
    }
    sections[detector] = section
    return config.model_copy(update={"detectors": type(config.detectors)(**sections)})


def _false_alarms_per_10k(corpus: Corpus, config: RunwatchConfig) -> float:
    alarms = steps = 0
    for label in corpus.labels:
        if not label.healthy:
            continue
        result = replay(corpus.events[label.name], config)
        alarms += sum(a.severity != "info" for a in result.anomalies)
        steps += result.steps
    return 10_000 * alarms / steps if steps else 0.0


def _faults_caught(corpus: Corpus, config: RunwatchConfig, detector: str) -> tuple[int, int]:
    labelled = [label for label in corpus.labels if label.expected_detector == detector]
    caught = 0
    for label in labelled:
        result = replay(corpus.events[label.name], config)
        caught += score_scenario(label, result.anomalies, result.steps).correct_detector
    return caught, len(labelled)


def calibrate(
    corpus: Corpus,
    target_false_alarms: float,
    base: RunwatchConfig | None = None,
    progress: Callable[[str, str, float, float], None] | None = None,
) -> tuple[RunwatchConfig, list[KnobProposal]]:
    """Propose a config; ``target_false_alarms`` is per 10,000 healthy steps, per detector."""
    if not any(label.healthy for label in corpus.labels):
        raise ValueError("calibration needs healthy recordings (fault == 'healthy') in the corpus")
    base = base or RunwatchConfig()
    proposals: list[KnobProposal] = []
    chosen_sections = {}
    for detector, knob in SENSITIVITY_KNOBS.items():
        section = getattr(base.detectors, detector)
        default = float(getattr(section, knob))
        tried: list[tuple[float, float]] = []
        best: tuple[float, float, BaseModel] | None = None
        for multiple in GRID:
            value = round(default * multiple, 6)
            candidate = _with_knob(section, knob, value)
            if candidate is None:
                continue
            rate = _false_alarms_per_10k(
                corpus, _only(base, detector, candidate.model_copy(update={"enabled": True}))
            )
            tried.append((value, round(rate, 3)))
            if progress is not None:
                progress(detector, knob, value, rate)
            if rate <= target_false_alarms:
                best = (value, rate, candidate)
                break  # the grid ascends: this is the most sensitive value that meets the target
        if best is None:  # nothing meets the target: the least sensitive value tried, flagged
            value, rate = tried[-1]
            fallback = _with_knob(section, knob, value)
            assert fallback is not None  # a value in ``tried`` made a valid section
            best = (value, rate, fallback)
            met = False
        else:
            met = True
        value, rate, new_section = best
        chosen_sections[detector] = new_section.model_copy(update={"enabled": section.enabled})
        caught, labelled = _faults_caught(
            corpus, _only(base, detector, new_section.model_copy(update={"enabled": True})), detector
        )
        proposals.append(
            KnobProposal(
                detector,
                knob,
                default,
                value,
                round(rate, 3),
                met,
                caught if labelled else None,
                labelled,
                tried,
            )
        )
    sections = {
        name: chosen_sections.get(name, getattr(base.detectors, name))
        for name in type(base.detectors).model_fields
    }
    proposed = base.model_copy(update={"detectors": type(base.detectors)(**sections)})
    return RunwatchConfig.model_validate(proposed.model_dump()), proposals


def resolution_per_10k(corpus: Corpus) -> float:
    """The smallest non-zero false-alarm rate the corpus can show: one alarm in all its healthy steps.
    A target below it cannot be confirmed, only not contradicted."""
    steps = sum(
        sum(1 for e in corpus.events[label.name] if e.kind == "step")
        for label in corpus.labels
        if label.healthy
    )
    return 10_000 / steps if steps else float("inf")


def to_yaml(
    config: RunwatchConfig, proposals: list[KnobProposal], target: float, resolution: float | None = None
) -> str:
    header = [f"# runwatch calibrate: target <= {target} false alarms per 10,000 healthy steps, per detector"]
    if resolution is not None and target < resolution:
        header.append(
            f"# caution: one alarm in these healthy runs is already {resolution:.3g} per 10k steps; "
            "record more healthy steps to confirm a target this low"
        )
    for p in proposals:
        note = "" if p.target_met else "  (target not met on this corpus)"
        caught = (
            f", catches {p.faults_caught}/{p.faults_labelled} labelled faults" if p.faults_labelled else ""
        )
        header.append(
            f"# {p.detector}.{p.knob}: {p.default:g} -> {p.proposed:g} "
            f"({p.false_alarms_per_10k:g} false alarms/10k{caught}){note}"
        )
    body = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    return "\n".join(header) + "\n" + body
