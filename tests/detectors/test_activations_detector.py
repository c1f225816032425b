"""The activations detector: names a module whose units die or whose output compounds; quiet otherwise."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import StepEvent
from runwatch.detectors.activations import ActivationsConfig, ActivationsDetector

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def drive(fault: str | None, steps: int = 400, onset: int = 200):
    det = ActivationsDetector(ActivationsConfig())
    rng = random.Random(0)
    findings = []
    for step in range(0, steps, 5):
        early = 1.0 + 2.0 * (1 - math.exp(-step / 30))  # healthy early growth, then a level
        acts = {}
        for name in ("fc", "act", "head"):
            rms = early * math.exp(rng.gauss(0, 0.03))
            zero = 0.3 + rng.gauss(0, 0.01) if name == "act" else 0.0
            if step >= onset and fault == "dead" and name == "act":
                zero = 0.92
            if step >= onset and fault == "growth" and name == "fc":
                rms *= 1.01 ** (step - onset + 1)
            acts[name] = {"rms": rms, "zero_frac": zero}
        event = StepEvent(run_id="r", step=step, ts=T0 + timedelta(seconds=step), module_activations=acts)
        findings += det.update(event, event.ts)
    return findings


def test_quiet_on_healthy_early_growth():
    assert drive(None) == []


def test_dead_units_named_at_the_first_sample():
    findings = drive("dead")
    assert [(f.step, f.evidence["module"], f.evidence["kind"]) for f in findings] == [(200, "act", "dead")]


def test_growth_named_within_60_steps():
    findings = drive("growth")
    assert len(findings) == 1
    f = findings[0]
    assert (f.evidence["module"], f.evidence["kind"]) == ("fc", "growth")
    assert 200 < f.step <= 260
