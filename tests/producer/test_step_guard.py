"""Issue 37, items 1 and 3: the guard that skips a bad update before it lands, and the rollback's LR
scale held in every step (through a scheduler) and undone after the healthy steps."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from runwatch.producer.instrument.guard import GuardOptions, StepGuard
from runwatch.producer.instrument.watch import Watcher
from runwatch.producer.publish.lr_hold import LRHold
from tests.producer.test_instrumentation import RecordingPublisher

# -- the guard's decision (pure logic) -----------------------------------------------------------


def test_a_nonfinite_gradient_is_always_skipped():
    guard = StepGuard()
    assert guard.judge(math.nan) == "nonfinite" and guard.judge(1.0, nonfinite_grads=3) == "nonfinite"
    assert all(guard.judge(math.inf) == "nonfinite" for _ in range(50))  # never lets one through
    assert guard.skipped == {"nonfinite": 52, "grad_spike": 0} and guard.in_a_row == 52
    assert guard.judge(1.0) is None and guard.in_a_row == 0


def test_a_spike_is_judged_against_the_recent_median_after_the_warmup():
    guard = StepGuard(GuardOptions(spike_ratio=10, warmup=20, max_spike_skips=3))
    assert guard.judge(1000.0) is None  # warming up: nothing to compare with yet
    for i in range(30):
        assert guard.judge(1.0 + 0.01 * (i % 5)) is None
    assert guard.limit == pytest.approx(10.2)
    assert guard.judge(9.0) is None  # a big but plausible norm is applied
    assert [guard.judge(50.0) for _ in range(4)] == ["grad_spike"] * 3 + [None]  # a new level: applied
    assert guard.skipped["grad_spike"] == 3


@pytest.mark.parametrize(
    "options",
    [{"spike_ratio": 1.0}, {"window": 10, "warmup": 11}, {"max_spike_skips": -1}, {"warmup": 0}],
)
def test_bad_guard_options_are_refused(options):
    with pytest.raises(ValueError):
        GuardOptions(**options)


# -- the guard in a real training step ------------------------------------------------------------


def _train(steps: int, nan_at: set[int], guard=True, scheduler=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    rw = RecordingPublisher()
    watch = Watcher(rw, model, optimizer, heartbeat_s=None, memory=False, guard=guard)
    nonfinite_weights_at = []
    for step in range(steps):
        x = torch.randn(32, 8)
        if step in nan_at:
            x[0, 0] = math.nan
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        watch.end_step(loss)
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            nonfinite_weights_at.append(step)
    watch.close()
    return rw.steps, nonfinite_weights_at, optimizer, watch


def test_a_nan_batch_never_reaches_the_weights_and_training_goes_on():
    events, nonfinite_weights_at, optimizer, watch = _train(40, nan_at={25})
    assert nonfinite_weights_at == []
    assert [e.step for e in events if e.update_skipped] == [25]
    assert events[25].update_skipped == "nonfinite" and math.isnan(events[25].loss)
    assert all(math.isfinite(e.loss) for e in events if e.step != 25)
    # Adam's state took 39 updates, not 40: the skipped step left it as it was
    assert {int(s["step"]) for s in optimizer.state.values()} == {39}
    assert watch.should_skip() is False
    # without the guard the same batch poisons every weight
    _, unguarded, _, _ = _train(40, nan_at={25}, guard=False)
    assert unguarded and unguarded[0] == 25


def test_a_gradscaler_overflow_is_not_a_skip_of_the_guard():
    """GradScaler skips an overflowing step itself (optimizer.step() is not called): not a fault."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)  # the first steps overflow
    rw = RecordingPublisher()
    watch = Watcher(rw, model, optimizer, heartbeat_s=None, memory=False)
    for _ in range(6):
        loss = model(torch.randn(8, 4)).pow(2).mean() * 1e8
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        watch.end_step(loss)
    watch.close()
    assert scaler.get_scale() < 2.0**120  # it did overflow, and backed off
    assert watch.guard is not None and watch.guard.skipped == {"nonfinite": 0, "grad_spike": 0}
    assert not any(e.update_skipped for e in rw.steps)


# -- the rollback's LR scale, held through a scheduler --------------------------------------------


def test_the_held_scale_survives_a_scheduler_and_returns_after_the_healthy_steps():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.01 * s))
    used: list[float] = []
    rw = RecordingPublisher()
    watch = Watcher(rw, model, optimizer, heartbeat_s=None, memory=False)
    optimizer.register_step_pre_hook(lambda o, _a, _k: used.append(o.param_groups[0]["lr"]))
    hold = LRHold.of(optimizer)
    assert hold is not None
    schedule = []
    for step in range(60):
        if step == 10:
            hold.hold(0.5, restore_after=20, restore_over=10)
        schedule.append(optimizer.param_groups[0]["lr"])  # what the scheduler set for this step
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        watch.end_step(0.0)
    ratio = [u / s for u, s in zip(used, schedule, strict=True)]
    assert ratio[:10] == pytest.approx([1.0] * 10)
    assert ratio[10:30] == pytest.approx([0.5] * 20)  # held for the 20 healthy steps, scheduler or not
    assert ratio[30:40] == pytest.approx([0.5 + 0.05 * k for k in range(1, 11)])  # back over 10 steps
    assert ratio[40:] == pytest.approx([1.0] * 20)
    # the scheduler itself never saw the scale: its schedule goes on as planned
    assert schedule[-1] == pytest.approx(0.1 / (1 + 0.01 * 59))
    # each step event says the scale its update used; the LR it reports is the one used
    assert [e.lr_scale for e in rw.steps[8:12]] == [None, None, 0.5, 0.5]
    assert rw.steps[12].lr == pytest.approx([used[12]])


def test_a_skipped_update_starts_the_count_to_the_restore_again():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = RecordingPublisher()
    watch = Watcher(rw, model, optimizer, heartbeat_s=None, memory=False)
    hold = LRHold.of(optimizer)
    assert hold is not None
    hold.hold(0.5, restore_after=10, restore_over=1)
    for step in range(25):
        x = torch.randn(8, 4)
        if step == 8:
            x[0, 0] = math.nan
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        watch.end_step(0.0)
        if step == 17:
            assert hold.scale == 0.5  # 9 healthy steps since the skip
    assert hold.scale == 1.0 and hold.healthy_steps >= 10


# -- the worker's side: a skipped update is said, not rolled back -----------------------------------


def test_a_spike_whose_update_was_skipped_is_info_and_not_learnt():
    from datetime import UTC, datetime

    from runwatch.contract.schema import StepEvent
    from runwatch.detectors.spike import SpikeConfig, StepSpike

    now = datetime(2026, 1, 1, tzinfo=UTC)
    guarded, plain = (StepSpike("loss_spike", "loss", SpikeConfig()) for _ in range(2))
    for s in range(40):
        for detector in (guarded, plain):
            assert (
                detector.update(StepEvent(run_id="r", step=s, loss=1.0 + 0.01 * (s % 5), ts=now), now) == []
            )
    [said] = guarded.update(
        StepEvent(run_id="r", step=40, loss=1e4, update_skipped="grad_spike", ts=now), now
    )
    [alarm] = plain.update(StepEvent(run_id="r", step=40, loss=1e4, ts=now), now)
    assert (said.severity, said.evidence["update_skipped"]) == ("info", True) and alarm.severity == "critical"
    # not learnt, and no divergence watched: the next steps (healthy) are quiet
    assert all(
        guarded.update(StepEvent(run_id="r", step=s, loss=1.0, ts=now), now) == [] for s in range(41, 60)
    )


def test_the_join_says_a_step_was_skipped_if_any_rank_skipped_it():
    from datetime import UTC, datetime

    from runwatch.contract.schema import StepEvent
    from runwatch.detectors.engine.step_partial import joined_fields, merge, partial_of

    now = datetime(2026, 1, 1, tzinfo=UTC)
    events = [
        StepEvent(run_id="r", rank=r, step=3, loss=1.0, update_skipped=skip, ts=now)
        for r, skip in enumerate([None, "grad_spike", "nonfinite", None])
    ]
    assert joined_fields("r", partial_of((0, 3), events, 4, []))["update_skipped"] == "nonfinite"
    halves = [partial_of((0, 3), events[:2], 2, []), partial_of((0, 3), events[2:], 2, [])]
    assert joined_fields("r", merge(halves, 4))["update_skipped"] == "nonfinite"
    assert joined_fields("r", partial_of((0, 3), [events[0]], 1, []))["update_skipped"] is None
