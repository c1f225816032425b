"""The update-ratio detector's per-step LR check: an LR fault is found at the step it happens (the update
norm is only measured every 10 steps), while the changes a schedule makes stay quiet."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import StepEvent
from runwatch.detectors.update_ratio import UpdateRatioConfig, UpdateRatioDetector

T0 = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)
RATIO = 1e-3  # the relative update norm of a healthy step at LR 1e-3 (it scales with the LR)


def _run(lrs: list[float], measure_every: int = 10) -> list[tuple[int, str, str]]:
    """(step, metric, direction) of every finding over a run with these per-step LRs; the update norm is
    measured every ``measure_every`` steps, proportional to the LR as for SGD and Adam."""
    detector = UpdateRatioDetector(UpdateRatioConfig())
    found = []
    for step, lr in enumerate(lrs):
        ratio = RATIO * lr / 1e-3 * (1 + 0.05 * math.sin(step)) if step % measure_every == 0 else None
        event = StepEvent(
            run_id="r", step=step, lr=[lr], relative_update_norm=ratio, ts=T0 + timedelta(seconds=step)
        )
        for f in detector.update(event, event.ts):
            found.append((step, f.metric, f.evidence["direction"]))
    return found


def _warmup_cosine(n: int, warmup: int = 20, peak: float = 1e-3) -> list[float]:
    return [
        peak * (s + 1) / warmup
        if s < warmup
        else peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (n - warmup))))
        for s in range(n)
    ]


def test_an_lr_x100_is_found_at_the_step_it_happens_not_at_the_next_measured_update():
    lrs = [1e-3] * 100 + [1e-1] * 100
    assert _run(lrs)[0] == (100, "lr", "too_large")


def test_an_lr_collapse_x1e4_is_found_at_once():
    lrs = [1e-3] * 103 + [1e-7] * 97
    assert _run(lrs)[0] == (103, "lr", "vanishing")


def test_a_milder_x10_inside_a_cosine_schedule_is_found_at_once():
    lrs = _warmup_cosine(300)
    lrs = lrs[:150] + [lr * 10 for lr in lrs[150:]]
    assert _run(lrs)[0] == (150, "lr", "too_large")


def test_the_finding_estimates_the_update_now_from_the_last_measured_one():
    detector = UpdateRatioDetector(UpdateRatioConfig())
    findings = []
    for step in range(120):
        lr = 1e-3 if step < 105 else 1e-1
        ratio = RATIO * lr / 1e-3 if step % 10 == 0 else None
        event = StepEvent(run_id="r", step=step, lr=[lr], relative_update_norm=ratio, ts=T0)
        findings += detector.update(event, T0)
    finding = findings[0]
    assert finding.step == 105 and finding.evidence["onset_step"] == 105
    # 1e-3 measured at step 100, the LR x100 since
    assert finding.evidence["estimated_ratio"] == pytest.approx(RATIO * 100)
    assert finding.severity == "critical"  # 0.1 of the weights per step: at the absolute ceiling
    assert "jumped 100x in one step (0.001 -> 0.1)" in finding.message


def test_schedules_stay_quiet():
    n = 300
    warm_restarts = [1e-3 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (s % 100) / 100))) for s in range(n)]
    step_drop = [1e-3 if s < 180 else 1e-4 for s in range(n)]
    warmup_from_zero = [1e-3 * s / 50 if s < 50 else 1e-3 for s in range(n)]
    ramp_up = [1e-4 * 1.02**s if s < 120 else 1e-4 * 1.02**120 for s in range(n)]  # a planned ramp
    anneal_to_zero = [1e-3 * max(0.0, 1 - s / 250) for s in range(n)]  # ends at exactly 0
    batch_doubling = [1e-3 if s < 150 else 2e-3 for s in range(n)]  # the LR scaled with the batch
    for lrs in (
        _warmup_cosine(n),
        warm_restarts,
        step_drop,
        warmup_from_zero,
        ramp_up,
        anneal_to_zero,
        batch_doubling,
    ):
        assert [f for f in _run(lrs) if f[1] == "lr"] == []


def test_a_warm_restart_above_its_earlier_peak_is_a_jump():
    lrs = [1e-3 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (s % 100) / 100))) for s in range(200)]
    lrs += [2e-2] * 50  # the "restart" goes 20x above anything the schedule had
    assert _run(lrs)[0] == (200, "lr", "too_large")
