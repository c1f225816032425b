"""A loop that replaces its optimizer without calling ``rw.watch`` again (issue 37): the watcher warns and
marks its step events; a GradScaler overflow step is not taken for it; the detector finds the swap from
the mark and, for an older producer, from gradient figures that stop."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import torch
from torch import nn

from runwatch.contract.schema import StepEvent
from runwatch.detectors.optimizer_swap import OptimizerSwapConfig, OptimizerSwapDetector
from runwatch.producer.instrument.optimizer_stepping import NOT_STEPPING_STEPS
from runwatch.producer.instrument.watch import Watcher
from tests.producer.test_instrumentation import RecordingPublisher, make

MARK = "optimizer_not_stepping"


def watched_loop(swap_at: int | None, steps: int = 30, zero_after: bool = False, rewatch: bool = False):
    """AdamW on the test net; at ``swap_at`` a new AdamW replaces it (and with ``rewatch`` a new watcher
    is made for it). ``zero_after``: gradients set to None after the step, before end_step."""
    model, x, y = make()
    rw = RecordingPublisher()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = Watcher(rw, model, optimizer, update_every=1, heartbeat_s=None, memory=False, guard=False)
    for step in range(steps):
        if step == swap_at:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if rewatch:
                watch.close()
                watch = Watcher(rw, model, optimizer, first_step=step, heartbeat_s=None, memory=False)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if zero_after:
            optimizer.zero_grad(set_to_none=True)
        watch.end_step(loss)
    watch.close()
    return rw.steps


def test_a_swapped_optimizer_is_warned_once_and_marks_the_steps_from_then_on(caplog):
    with caplog.at_level(logging.WARNING, logger="runwatch.producer.instrument.watch"):
        steps = watched_loop(swap_at=20)
    before, after = steps[:20], steps[20:]
    assert all(s.grad_norm is not None and s.instrumentation is None for s in before)
    assert all(s.grad_norm is None and s.param_norm is None for s in after)
    marked = [s.step for s in after if s.instrumentation == MARK]
    assert marked == list(range(20 + NOT_STEPPING_STEPS - 1, 30))
    warnings = [r.getMessage() for r in caplog.records if "has not stepped" in r.getMessage()]
    assert len(warnings) == 1
    assert "rw.watch(model, new_optimizer)" in warnings[0]


def test_a_loop_that_zeroes_gradients_before_end_step_is_still_seen():
    steps = watched_loop(swap_at=20, zero_after=True)
    marked = [s.step for s in steps if s.instrumentation == MARK]
    assert marked == list(range(20 + NOT_STEPPING_STEPS - 1, 30))


def test_watching_the_new_optimizer_clears_it(caplog):
    with caplog.at_level(logging.WARNING, logger="runwatch.producer.instrument.watch"):
        steps = watched_loop(swap_at=20, rewatch=True)
    assert len(steps) == 30
    assert all(s.instrumentation is None and s.grad_norm is not None for s in steps)
    assert not [r for r in caplog.records if "has not stepped" in r.getMessage()]


def test_a_grad_scaler_overflow_step_is_not_taken_for_a_swap(caplog):
    model, x, y = make()
    rw = RecordingPublisher()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    watch = Watcher(rw, model, optimizer, heartbeat_s=None, memory=False, guard=False)
    overflow = {5, 12, 13}  # one overflow, then two in a row: fewer than NOT_STEPPING_STEPS
    with caplog.at_level(logging.WARNING, logger="runwatch.producer.instrument.watch"):
        for step in range(20):
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            if step in overflow:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skips optimizer.step() on an overflow
            scaler.update()
            watch.end_step(loss.detach())
        watch.close()
    assert [s.step for s in rw.steps if s.grad_norm is None] == sorted(overflow)
    assert all(s.instrumentation is None for s in rw.steps)
    assert not [r for r in caplog.records if "has not stepped" in r.getMessage()]


def test_the_mark_ends_when_the_watched_optimizer_steps_again():
    model, x, y = make()
    rw = RecordingPublisher()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    other = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = Watcher(rw, model, optimizer, heartbeat_s=None, memory=False, guard=False)
    for step in range(15):
        active = other if 5 <= step < 10 else optimizer
        active.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        active.step()
        watch.end_step(loss)
    watch.close()
    assert [s.step for s in rw.steps if s.instrumentation == MARK] == [7, 8, 9]


def test_hooks_false_is_never_marked():
    model, x, y = make()
    rw = RecordingPublisher()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    watch = Watcher(rw, model, optimizer, hooks=False, heartbeat_s=None, memory=False, guard=False)
    for _ in range(6):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        watch.end_step(loss)
    watch.close()
    assert all(s.instrumentation is None for s in rw.steps)


# -- the detector ------------------------------------------------------------------------------------

NOW = datetime(2026, 11, 29, tzinfo=UTC)


def feed(events: list[StepEvent]):
    detector = OptimizerSwapDetector(OptimizerSwapConfig())
    findings = []
    for event in events:
        findings.extend(detector.update(event, NOW))
    return findings


def test_the_detector_names_the_swap_from_the_producers_mark():
    events = [StepEvent(run_id="r", step=s, grad_norm=1.0) for s in range(20)]
    events += [
        StepEvent(run_id="r", step=s, instrumentation=MARK if s >= 22 else None) for s in range(20, 40)
    ]
    findings = feed(events)
    assert len(findings) == 1
    f = findings[0]
    assert f.severity == "warning" and f.step == 22
    assert "the optimizer swap" in f.message and "step 20" in f.message
    assert f.evidence["kind"] == "optimizer_swap" and f.evidence["onset_step"] == 20


def test_the_detector_finds_an_older_producers_swap_from_gradients_that_stop():
    events = [StepEvent(run_id="r", step=s, grad_norm=1.0, loss=1.0) for s in range(30)]
    events += [StepEvent(run_id="r", step=s, loss=1.0) for s in range(30, 50)]
    findings = feed(events)
    assert len(findings) == 1
    assert findings[0].step == 34 and findings[0].evidence["onset_step"] == 30
    assert "the optimizer swap" in findings[0].message


def test_the_detector_is_quiet_on_a_short_gap_or_a_run_that_never_had_gradients():
    gap = [StepEvent(run_id="r", step=s, grad_norm=None if 25 <= s < 29 else 1.0) for s in range(60)]
    never = [StepEvent(run_id="r", step=s, loss=1.0) for s in range(60)]
    short = [StepEvent(run_id="r", step=s, grad_norm=1.0) for s in range(10)]
    short += [StepEvent(run_id="r", step=s) for s in range(10, 30)]
    assert feed(gap) == [] and feed(never) == [] and feed(short) == []
