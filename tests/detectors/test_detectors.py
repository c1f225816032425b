"""The online detectors. NonFiniteDetector must flag the very first NaN/Inf step and escalate to
critical after ``max_consecutive``; SpikeDetector must catch a real loss/grad-norm spike at its step,
stay silent on healthy heavy-tailed noise and on an ordinary decreasing training curve, and its state
must survive pickling (the worker snapshots and restores it)."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from runwatch.contract.schema import StepEvent
from runwatch.detectors.config import NonFiniteConfig, SpikeConfig
from runwatch.detectors.nonfinite import NonFiniteDetector
from runwatch.detectors.spike import SpikeDetector

# -- NonFiniteDetector ----------------------------------------------------------------------------


def _step(step: int, loss: float | None = 1.0, **fields) -> StepEvent:
    return StepEvent(run_id="r", step=step, loss=loss, **fields)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_first_non_finite_step_is_a_warning_at_that_step(bad):
    det = NonFiniteDetector(NonFiniteConfig(max_consecutive=3))
    for s in range(10):
        assert det.update(_step(s, loss=2.0)) is None
    finding = det.update(_step(10, loss=bad))
    assert finding is not None
    assert finding.step == 10  # detection delay 0: on the fault step itself
    assert finding.severity == "warning"
    assert finding.detector == "non_finite"
    assert finding.metric == "loss"
    assert finding.evidence["onset_step"] == 10
    assert finding.evidence["consecutive"] == 1


def test_streak_reaching_max_consecutive_is_critical_with_onset():
    det = NonFiniteDetector(NonFiniteConfig(max_consecutive=3))
    det.update(_step(0))
    findings = [det.update(_step(s, loss=math.nan)) for s in range(1, 7)]
    assert findings[0].severity == "warning"
    assert findings[1] is None
    critical = findings[2]
    assert critical is not None and critical.severity == "critical"
    assert critical.step == 3
    assert critical.evidence["onset_step"] == 1
    assert critical.evidence["consecutive"] == 3
    # one critical per streak: the policy must not be asked for a rollback on every NaN step
    assert findings[3:] == [None, None, None]


def test_max_consecutive_one_is_critical_immediately():
    det = NonFiniteDetector(NonFiniteConfig(max_consecutive=1))
    finding = det.update(_step(4, loss=math.inf))
    assert finding.severity == "critical" and finding.evidence["onset_step"] == 4


def test_a_finite_step_resets_the_streak():
    det = NonFiniteDetector(NonFiniteConfig(max_consecutive=3))
    assert det.update(_step(1, loss=math.nan)).severity == "warning"
    assert det.update(_step(2, loss=math.nan)) is None
    assert det.update(_step(3, loss=1.0)) is None
    again = det.update(_step(4, loss=math.nan))
    assert again.severity == "warning"  # not critical: the earlier streak ended at step 3
    assert again.evidence["onset_step"] == 4
    assert det.update(_step(5, loss=math.nan)) is None
    assert det.update(_step(6, loss=math.nan)).severity == "critical"


def test_nonfinite_grads_alone_counts():
    det = NonFiniteDetector(NonFiniteConfig(max_consecutive=2))
    first = det.update(_step(7, loss=1.0, grad_norm=3.0, nonfinite_grads=5))
    assert first is not None and first.severity == "warning"
    assert first.metric == "grads"
    assert first.evidence["nonfinite_grads"] == 5
    assert det.update(_step(8, loss=1.0, nonfinite_grads=1)).severity == "critical"


def test_non_finite_grad_norm_alone_counts():
    det = NonFiniteDetector(NonFiniteConfig())
    finding = det.update(_step(3, loss=1.0, grad_norm=math.inf))
    assert finding is not None and finding.metric == "grad_norm"


def test_finite_and_missing_values_are_healthy():
    det = NonFiniteDetector(NonFiniteConfig())
    assert det.update(_step(0, loss=None)) is None
    assert det.update(_step(1, loss=1e30, grad_norm=0.0, nonfinite_grads=0)) is None
    assert det.streak == 0


# -- SpikeDetector --------------------------------------------------------------------------------


def _feed(det: SpikeDetector, values, start: int = 0):
    return [f for i, v in enumerate(values) if (f := det.update(float(v), start + i)) is not None]


def _lognormal(seed: int, n: int, sigma: float = 0.3, scale: float = 2.0) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(0.0, sigma, n) * scale


def test_no_finding_during_warmup_even_for_a_huge_value():
    cfg = SpikeConfig(warmup=20)
    det = SpikeDetector("loss_spike", "loss", cfg)
    values = list(_lognormal(1, 19))
    assert _feed(det, values) == []
    assert det.update(1e9, 19) is None  # the 20th value is still warm-up
    assert det.seen == 20


def test_fifty_x_spike_after_warmup_is_found_at_its_step():
    values = _lognormal(7, 300)
    values[200] *= 50
    det = SpikeDetector("loss_spike", "loss", SpikeConfig())
    findings = _feed(det, values)
    assert [f.step for f in findings] == [200]
    spike = findings[0]
    assert spike.detector == "loss_spike" and spike.metric == "loss"
    assert spike.value == pytest.approx(values[200])
    assert spike.score >= SpikeConfig().z_threshold
    assert spike.evidence["ratio"] > 20
    assert spike.threshold < spike.value


def test_spike_severity_depends_on_critical_z():
    values = _lognormal(7, 300)
    values[200] *= 50
    lenient = SpikeConfig(z_threshold=6, critical_z=1000)
    assert _feed(SpikeDetector("s", "loss", lenient), values)[0].severity == "warning"
    strict = SpikeConfig(z_threshold=6, critical_z=6)
    assert _feed(SpikeDetector("s", "loss", strict), values)[0].severity == "critical"


def test_healthy_heavy_tailed_noise_gives_no_findings():
    rng = np.random.default_rng(2024)
    values = rng.lognormal(0.0, 0.3, 2000) * 3.0
    bumps = rng.random(2000) < 0.05
    values[bumps] *= 1.5  # occasional hard batches
    det = SpikeDetector("grad_norm_spike", "grad_norm", SpikeConfig())
    assert _feed(det, values) == []
    assert det.seen == 2000


def test_decreasing_training_curve_gives_no_findings():
    rng = np.random.default_rng(5)
    steps = np.arange(3000)
    loss = 0.4 + 6.0 * np.exp(-steps / 400.0)
    loss = loss * np.exp(rng.normal(0.0, 0.02, steps.size))
    det = SpikeDetector("loss_spike", "loss", SpikeConfig())
    assert _feed(det, loss) == []


def test_small_bump_on_a_flat_series_is_not_a_spike():
    # min_scale and min_ratio: a near-constant series must not turn a 1.5x bump into an alarm
    det = SpikeDetector("loss_spike", "loss", SpikeConfig())
    flat = [1.0] * 100
    assert _feed(det, flat + [1.5] + flat, 0) == []
    found = _feed(SpikeDetector("loss_spike", "loss", SpikeConfig()), flat + [3.0])
    assert [f.step for f in found] == [100]


def test_non_finite_and_non_positive_values_are_ignored():
    base = _lognormal(11, 200)
    base[150] *= 40
    clean = _feed(SpikeDetector("s", "loss", SpikeConfig()), base)

    det = SpikeDetector("s", "loss", SpikeConfig())
    noisy_findings = []
    for i, v in enumerate(base):
        for junk in (math.nan, math.inf, -math.inf, 0.0, -5.0, None):
            assert det.update(junk, i) is None
        if (f := det.update(float(v), i)) is not None:
            noisy_findings.append(f)
    assert det.seen == len(base)  # the junk was not counted as history
    assert [f.step for f in clean] == [150]
    assert noisy_findings == clean


def test_cooldown_suppresses_back_to_back_findings():
    values = list(_lognormal(3, 100))
    spikes = {100: 60.0, 102: 60.0, 104: 60.0, 106: 60.0}
    typical = float(np.median(values))
    continuation = [typical * spikes.get(s, 1.0) for s in range(100, 112)]

    det = SpikeDetector("s", "loss", SpikeConfig(cooldown_steps=5))
    found = _feed(det, values + continuation)
    assert [f.step for f in found] == [100, 106]

    det0 = SpikeDetector("s", "loss", SpikeConfig(cooldown_steps=0))
    assert [f.step for f in _feed(det0, values + continuation)] == [100, 102, 104, 106]


def test_state_pickles_and_continues_identically():
    rng = np.random.default_rng(99)
    history = rng.lognormal(0.0, 0.3, 300)
    continuation = rng.lognormal(0.0, 0.3, 300)
    for s in (40, 120, 250):
        continuation[s] *= 30

    original = SpikeDetector("loss_spike", "loss", SpikeConfig())
    assert _feed(original, history) == []
    restored = pickle.loads(pickle.dumps(original))

    expected = _feed(original, continuation, start=300)
    got = _feed(restored, continuation, start=300)
    assert [f.step for f in expected] == [340, 420, 550]
    assert got == expected


def test_fresh_detector_differs_from_a_restored_one():
    # guards the pickling test: without the restored history the same continuation reads differently
    rng = np.random.default_rng(99)
    history = rng.lognormal(0.0, 0.3, 300)
    continuation = rng.lognormal(0.0, 0.3, 300)
    continuation[10] *= 30
    warmed = SpikeDetector("s", "loss", SpikeConfig())
    _feed(warmed, history)
    assert [f.step for f in _feed(warmed, continuation, 300)] == [310]
    assert _feed(SpikeDetector("s", "loss", SpikeConfig()), continuation, 300) == []


def test_non_finite_detector_state_pickles():
    det = NonFiniteDetector(NonFiniteConfig(max_consecutive=3))
    det.update(_step(1, loss=math.nan))
    det.update(_step(2, loss=math.nan))
    restored = pickle.loads(pickle.dumps(det))
    finding = restored.update(_step(3, loss=math.nan))
    assert finding.severity == "critical" and finding.evidence["onset_step"] == 1
