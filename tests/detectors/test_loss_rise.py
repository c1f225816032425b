"""The gradual-rise detector (issue 27): a training loss that climbs slowly, with no step that jumps, is
found (an LR multiplied by 1.01 every step, updates that grow, or no visible cause), and the finding
names the cause the telemetry shows; what the schedule explains (a warm restart back to the peak LR, a
long warm-up whose loss bumps) and noise stay quiet; one finding per episode, found again after a
rollback. Every stream is seeded."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import torch
from torch import nn

from runwatch.contract.schema import StepEvent
from runwatch.detectors import registry
from runwatch.detectors.config import PolicyConfig, RunwatchConfig
from runwatch.detectors.engine.policy import ActionPolicy
from runwatch.detectors.findings import Finding
from runwatch.detectors.loss_rise import LossRiseConfig, LossRiseDetector, theil_sen
from runwatch.scenarios.faults import FaultRun, LrRamp
from runwatch.scenarios.variants import loss_rise as variants

T0 = datetime(2026, 11, 27, 9, 0, tzinfo=UTC)
ONSET = 200
LR = 1e-3


def _plateau(step: int) -> float:
    """A loss that falls fast and then levels off near 0.3, as small training runs do."""
    return 0.3 + 2.0 * math.exp(-step / 40)


def _events(
    n: int,
    loss: Callable[[int], float],
    lr: Callable[[int], float] = lambda _s: LR,
    ratio: Callable[[int], float] | None = None,
    seed: int = 0,
    noise: float = 0.15,
    start: int = 0,
) -> list[StepEvent]:
    """Step events ``start`` .. ``n - 1``: the loss times lognormal noise, the LR, and the relative update
    norm every fifth step (as the Watcher measures it)."""
    rng = random.Random(seed)
    events = []
    for step in range(n):
        jitter = math.exp(rng.gauss(0, noise))
        if step < start:
            continue
        events.append(
            StepEvent(
                run_id="rise",
                step=step,
                ts=T0 + timedelta(seconds=step),
                event_id=f"s{step}",
                loss=loss(step) * jitter,
                lr=[lr(step)],
                relative_update_norm=ratio(step) if ratio is not None and step % 5 == 0 else None,
            )
        )
    return events


def _run(events: list[StepEvent], detector: LossRiseDetector | None = None) -> list[Finding]:
    detector = detector or LossRiseDetector(LossRiseConfig())
    return [f for e in events for f in detector.update(e, e.ts)]


def _creeping_lr(step: int) -> float:
    """The issue's fault: the LR multiplied by 1.01 every step from the onset."""
    return LR * 1.01 ** max(0, step - ONSET + 1)


def _rising(step: int) -> float:
    """The loss a creeping LR gives: level, then up by half the LR's growth (x1.65 after 100 steps)."""
    return _plateau(step) * math.exp(0.005 * max(0, step - ONSET))


# -- found, naming the cause -------------------------------------------------------------------------


def test_an_lr_multiplied_every_step_raises_the_loss_and_is_found_naming_the_lr():
    findings = _run(_events(500, _rising, lr=_creeping_lr))
    assert len(findings) == 1
    f = findings[0]
    assert f.detector == "loss_rise" and f.metric == "loss" and f.severity == "warning"
    assert ONSET < f.step <= ONSET + 120, f.step  # found within ~100 steps of a x1.01/step ramp
    assert ONSET - 20 <= f.evidence["onset_step"] < f.step
    assert f.onset_step == f.evidence["onset_step"]
    assert f.evidence["cause"] == "lr_rise" and f.evidence["ratio"] >= 1.3
    assert f.evidence["lr_now"] > 1.5 * f.evidence["lr_before"]
    assert "training loss rising" in f.message and "likely cause: the LR rose with it" in f.message
    # in losses a person reads, not log-losses: the level and the best level as they are
    assert f"{f.evidence['level']:.4g}" in f.message and f"{f.evidence['best_level']:.4g}" in f.message


def test_an_lr_past_every_lr_the_run_had_is_evidence_too_so_a_noisy_rise_is_found_sooner():
    with_lr = _run(_events(500, _rising, lr=_creeping_lr, noise=0.3))
    same_loss_at_a_constant_lr = _run(_events(500, _rising, noise=0.3))
    assert len(with_lr) == len(same_loss_at_a_constant_lr) == 1
    assert with_lr[0].step + 40 <= same_loss_at_a_constant_lr[0].step
    assert with_lr[0].evidence["cause"] == "lr_rise"


def test_updates_that_grow_at_the_same_lr_are_named_as_the_cause():
    growing = _events(500, _rising, ratio=lambda s: 1e-3 * 1.01 ** max(0, s - ONSET))
    [f] = _run(growing)
    assert f.evidence["cause"] == "update_growth"
    assert f.evidence["update_ratio_now"] > 1.5 * f.evidence["update_ratio_before"]
    assert "likely cause: the updates grew" in f.message


def test_a_rise_with_neither_lr_nor_updates_growing_is_found_without_a_cause():
    [f] = _run(_events(500, _rising, ratio=lambda _s: 1e-3))
    assert f.evidence["cause"] is None
    assert "neither the LR nor the update size grew" in f.message


def test_a_rise_without_any_lr_in_the_events_is_still_found():
    events = [e.model_copy(update={"lr": []}) for e in _events(500, _rising)]
    [f] = _run(events)
    assert f.evidence["lr_before"] is None and f.evidence["cause"] is None


# -- quiet: noise, small rises, the schedule ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_a_noisy_heavy_tailed_loss_that_levels_off_stays_quiet(seed):
    rng = random.Random(100 + seed)
    spikes = {s for s in range(3000) if rng.random() < 0.02}  # one step in fifty is x4

    def loss(step: int) -> float:
        return _plateau(step) * (1 - 0.1 * step / 3000) * (4.0 if step in spikes else 1.0)

    assert _run(_events(3000, loss, seed=seed, noise=0.35)) == []


def test_a_rise_short_of_min_ratio_stays_quiet_and_one_past_it_is_found():
    def rise_to(top: float) -> Callable[[int], float]:
        return lambda s: 0.3 * (1 + (top - 1) * min(1.0, max(0, s - ONSET) / 100))

    assert _run(_events(400, rise_to(1.2), noise=0.02)) == []
    assert len(_run(_events(400, rise_to(1.6), noise=0.02))) == 1


def _restarts(step: int) -> float:
    """Cosine annealing with warm restarts every 200 steps to a peak LR of 1e-2."""
    return 5e-4 + 0.5 * (1e-2 - 5e-4) * (1 + math.cos(math.pi * (step % 200) / 200))


def _climbs_after_restarts(step: int) -> float:
    """The loss climbs x2.4 over the 40 steps after each restart, then anneals back down."""
    since = step % 200
    bump = 1 + 1.4 * min(since, 40) / 40 * math.exp(-max(0, since - 40) / 40) if step >= 200 else 1.0
    return _plateau(step) * bump


def test_a_loss_that_climbs_after_each_warm_restart_is_the_schedule():
    assert _run(_events(800, _climbs_after_restarts, lr=_restarts)) == []
    # the same climb at an LR that did not go up is found: the schedule is what made it quiet
    assert _run(_events(800, _climbs_after_restarts))


def _long_warmup(step: int) -> float:
    return 1e-2 * min(1.0, (step + 1) / 200)


def _bumps_during_warmup(step: int) -> float:
    """Falls, then bumps up to x2.5 and back while the LR still rises (steps 100-250), then falls again."""
    return _plateau(step) * (1 + 1.5 * math.sin(math.pi * (step - 100) / 150) if 100 <= step < 250 else 1.0)


def test_a_loss_that_bumps_during_a_long_warm_up_is_the_schedule():
    assert _run(_events(600, _bumps_during_warmup, lr=_long_warmup)) == []
    # the same bump at a constant LR is found: the warm-up is what made it quiet
    assert _run(_events(600, _bumps_during_warmup))


def test_an_lr_that_goes_past_every_lr_the_run_had_is_not_the_schedule():
    """After a warm-up to 1e-2 and a cosine decay to 2e-3, the LR creeps up x1.01 per step from step 300:
    back to the warm-up's peak (step 462) it is an LR the run had run at, past it the loss rises and that
    is no longer the schedule's."""

    def decay_then_creep(step: int) -> float:
        if step < 200:
            return _long_warmup(step)
        decayed = 2e-3 + 0.5 * 8e-3 * (1 + math.cos(math.pi * min(1.0, (step - 200) / 100)))
        return decayed * 1.01 ** max(0, step - 300)

    def loss(step: int) -> float:
        return _plateau(step) * max(1.0, decay_then_creep(step) / 1e-2) ** 0.7

    [f] = _run(_events(700, loss, lr=decay_then_creep))
    assert f.evidence["cause"] == "lr_rise" and decay_then_creep(f.step) > 1e-2


# -- episodes and rollbacks ---------------------------------------------------------------------------


def test_one_finding_per_episode_and_another_once_the_loss_came_back_and_rose_again():
    def twice(step: int) -> float:
        up = min(1.0, max(0, step - 200) / 100) if step < 450 else min(1.0, max(0, step - 700) / 100)
        return 0.3 * (1 + 0.8 * up)

    findings = _run(_events(1000, twice, noise=0.05))
    assert len(findings) == 2
    assert 200 < findings[0].step < 450 and 700 < findings[1].step


def test_a_replay_after_a_rollback_finds_the_rise_again():
    """Without the monitor's snapshots: the points from the restored step on are forgotten. Restored at a
    block's end (step 149, training resumes at 150) the replay gives the same finding; elsewhere (150) the
    blocks shift by a step, and the rise is found again all the same."""
    detector = LossRiseDetector(LossRiseConfig())
    first = _run(_events(450, _rising, lr=_creeping_lr), detector)
    again = _run(_events(450, _rising, lr=_creeping_lr, start=150), detector)
    assert len(first) == 1
    assert [(f.step, f.message) for f in again] == [(f.step, f.message) for f in first]
    shifted = _run(_events(450, _rising, lr=_creeping_lr, start=151), detector)
    assert len(shifted) == 1 and abs(shifted[0].step - first[0].step) <= 20


def test_a_step_delivered_twice_changes_nothing():
    events = _events(500, _rising, lr=_creeping_lr)
    doubled = [x for e in events for x in ((e, e) if e.step % 7 == 0 else (e,))]
    assert _run(doubled) == _run(events)


# -- pieces --------------------------------------------------------------------------------------------


def test_theil_sen_gives_the_slope_and_end_level_and_shrugs_off_one_outlier():
    assert theil_sen([0.0, 1.0, 2.0, 3.0]) == (1.0, 3.0)
    slope, level = theil_sen([0.0, 1.0, 2.0, 30.0, 4.0, 5.0])
    assert slope == 1.0 and level == 5.0


def test_windows_longer_than_the_history_are_a_config_error():
    with pytest.raises(ValueError, match="history_blocks"):
        LossRiseConfig(window_blocks=8, level_blocks=5, history_blocks=12)


def test_the_default_policy_alerts_on_a_rise_and_does_not_roll_back():
    policy = ActionPolicy(PolicyConfig())
    assert policy.action_for("loss_rise", "warning") == "alert"
    assert not policy.rolls_back_on("loss_rise")
    assert RunwatchConfig().detectors.loss_rise == LossRiseConfig()


def test_the_lr_ramp_injector_multiplies_the_schedule_from_the_onset_and_is_labelled_for_this_detector():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ramp = LrRamp(factor_per_step=1.01).for_run()
    ramp.start(FaultRun(onset=10, steps=100, model=model, base_lr=lambda _s: 0.1))
    lrs = []
    for step in (5, 10, 11, 109):
        optimizer.param_groups[0]["lr"] = 0.1
        ramp.before_step(step, optimizer)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.1, 0.1 * 1.01, 0.1 * 1.01**2, 0.1 * 1.01**100])
    assert registry.detector_for_fault()[LrRamp.kind] == "loss_rise"
    assert ramp.label_fields() == {"magnitude": 1.01}


def test_the_variants_hold_the_ramp_faults_and_their_healthy_look_alikes():
    faults = [s for s in variants.VARIANTS if s.fault == "loss_rise"]
    healthy = [s for s in variants.VARIANTS if s.fault == "healthy"]
    assert faults and all(s.onset is not None for s in faults)
    assert {b for s in healthy for b in s.benign} >= {"lr_warmup_peak", "lr_restart"}


def test_the_best_level_kept_as_points_come_and_go_is_the_lowest_of_the_history():
    """The best level is kept as blocks close, leave the history (past ``history_blocks``) and are replayed
    away by a rollback, instead of scanning the whole history at every block: after each block it is what
    the scan gives (the lowest level, its first index), through a long run and rewinds."""
    config = LossRiseConfig(history_blocks=20, noise_blocks=10)
    detector = LossRiseDetector(config)
    rng = random.Random(7)
    events = _events(1200, lambda s: 0.3 + 0.2 * math.sin(s / 37) + 0.05 * rng.random(), noise=0.1)
    events += _events(900, _plateau, start=600, seed=3) + _events(300, _plateau, start=250, seed=4)  # rewinds
    checked = 0
    for event in events:
        detector.update(event, event.ts)
        if detector._levels:
            lowest = min(detector._levels)
            assert detector._best() == (lowest, detector._levels.index(lowest))
            checked += 1
    assert checked > 1500


def test_a_detector_pickled_before_it_kept_its_best_level_carries_on():
    events = _events(450, _rising, lr=_creeping_lr)
    detector = LossRiseDetector(LossRiseConfig())
    _run(events[:300], detector)
    state = detector.__dict__.copy()
    state.pop("_best_level", None)  # as the code before it pickled the detector
    restored = LossRiseDetector.__new__(LossRiseDetector)
    restored.__dict__.update(state)
    assert _run(events[300:], restored) == _run(events[300:], detector)
    assert len(_run(events, LossRiseDetector(LossRiseConfig()))) == 1
