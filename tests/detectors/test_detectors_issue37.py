"""The issue-37 detectors on synthetic streams: each finds its shape, naming what it must, and a
healthy stream with the benign look-alike stays quiet."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import EvalEvent, StepEvent
from runwatch.detectors.eval_category import EvalCategoryConfig, EvalCategoryDetector
from runwatch.detectors.frozen_modules import FrozenModulesConfig, FrozenModulesDetector
from runwatch.detectors.param_norm import ParamNormConfig, ParamNormDetector
from runwatch.detectors.val_train_gap import ValTrainGapConfig, ValTrainGapDetector

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def step(i: int, **fields) -> StepEvent:
    return StepEvent(run_id="r", step=i, ts=T0 + timedelta(seconds=i), **fields)


def evaluation(i: int, loss: float, split: str = "val", **fields) -> EvalEvent:
    return EvalEvent(run_id="r", step=i, ts=T0 + timedelta(seconds=i), split=split, loss=loss, **fields)


def drive(detector, events):
    return [f for e in events for f in detector.update(e, e.ts)]


def module_steps(n: int, frozen_at: int | None = None, frozen_until: int | None = None, gone: bool = False):
    rng = random.Random(0)
    for i in range(n):
        norms = {m: 0.5 * math.exp(rng.gauss(0, 0.2)) for m in ("enc.0", "enc.2", "head")}
        if frozen_at is not None and i >= frozen_at:
            for m in ("enc.0", "enc.2"):
                if gone:
                    del norms[m]
                else:
                    norms[m] = 0.0
        if frozen_until is not None and i < frozen_until:
            norms["enc.0"] = 0.0
        yield step(i, module_grad_norms=norms)


def test_frozen_modules_named_within_patience():
    found = drive(FrozenModulesDetector(FrozenModulesConfig()), module_steps(200, frozen_at=120))
    assert len(found) == 1
    f = found[0]
    assert f.step == 124 and f.evidence["modules"] == ["enc.0", "enc.2"] and f.evidence["module"] == "enc.0"
    assert f.onset_step == 120 and f.evidence["kind"] == "frozen"


def test_modules_that_vanish_count_as_frozen():
    found = drive(FrozenModulesDetector(FrozenModulesConfig()), module_steps(200, frozen_at=120, gone=True))
    assert [f.evidence["absent"] for f in found] == [["enc.0", "enc.2"]]


def test_frozen_from_the_start_then_unfrozen_is_quiet():
    assert drive(FrozenModulesDetector(FrozenModulesConfig()), module_steps(300, frozen_until=90)) == []


def test_every_module_at_zero_is_not_one_modules_fault():
    events = [
        step(i, module_grad_norms={"a": 0.0 if i >= 50 else 1.0, "b": 0.0 if i >= 50 else 1.0})
        for i in range(80)
    ]
    assert drive(FrozenModulesDetector(FrozenModulesConfig()), events) == []


def param_steps(n: int, fall_at: int | None = None, decay_from_start: bool = False):
    rng = random.Random(1)
    x = math.log(10.0)
    for i in range(0, n, 5):
        growth = 0.004 * math.exp(-i / 150)  # the healthy slow growth, slowing down
        if decay_from_start:
            growth = -0.002
        if fall_at is not None and i >= fall_at:
            growth = -0.0015
        x += 5 * growth + rng.gauss(0, 0.0005)
        yield step(i, param_norm=math.exp(x))


def test_param_norm_fall_named_within_60_steps():
    found = drive(ParamNormDetector(ParamNormConfig()), param_steps(300, fall_at=120))
    assert len(found) == 1
    f = found[0]
    assert (
        120 < f.step <= 180 and f.evidence["kind"] == "falling" and f.evidence["cause"] == "weights_shrinking"
    )


def test_param_norm_healthy_growth_and_steady_decay_are_quiet():
    assert drive(ParamNormDetector(ParamNormConfig()), param_steps(400)) == []
    assert drive(ParamNormDetector(ParamNormConfig()), param_steps(400, decay_from_start=True)) == []


def category_evals(n_evals: int, bad_at: int | None = None, laggard: bool = False):
    rng = random.Random(2)
    for k in range(n_evals):
        i = 10 * k + 9
        base = 2.3 * math.exp(-i / 100) + 0.3
        cats = {}
        for j, c in enumerate(("en", "de", "fr", "es", "it")):
            loss = base * (1 + 0.05 * j) * math.exp(rng.gauss(0, 0.04))
            if laggard and c == "it":
                loss = (base + 0.5 * (1 - math.exp(-i / 100))) * math.exp(rng.gauss(0, 0.04))  # learns slower
            if bad_at is not None and c == "fr" and i >= bad_at:
                loss *= min(2.0, 1 + (i - bad_at) / 20)
            cats[c] = {"loss": loss, "count": 40.0}
        yield evaluation(i, base, per_category=cats)


def test_eval_category_named_within_60_steps():
    found = drive(EvalCategoryDetector(EvalCategoryConfig()), category_evals(30, bad_at=120))
    assert len(found) == 1
    f = found[0]
    assert 120 <= f.step <= 180 and f.evidence["category"] == "fr" and f.evidence["split"] == "val"


def test_eval_category_healthy_and_a_slow_learner_are_quiet():
    assert drive(EvalCategoryDetector(EvalCategoryConfig()), category_evals(40)) == []
    assert drive(EvalCategoryDetector(EvalCategoryConfig()), category_evals(40, laggard=True)) == []


def gap_stream(n: int, leak_at: int | None = None, train_rise_at: int | None = None):
    rng = random.Random(3)
    events = []
    for i in range(n):
        train = 2.0 * math.exp(-i / 120) + 0.1
        if train_rise_at is not None and i >= train_rise_at:
            train *= 2.0
        events.append(step(i, loss=train * math.exp(rng.gauss(0, 0.05))))
        if i % 10 == 9:
            val = (2.0 * math.exp(-i / 120) + 0.1) * 1.4 * math.exp(rng.gauss(0, 0.02))
            if leak_at is not None and i >= leak_at:
                val *= max(0.65, 1 - 0.02 * (i - leak_at))
            events.append(evaluation(i, val))
    return events


def test_val_train_gap_closing_names_the_split_within_60_steps():
    found = drive(ValTrainGapDetector(ValTrainGapConfig()), gap_stream(300, leak_at=150))
    assert len(found) == 1
    f = found[0]
    assert 150 <= f.step <= 210 and f.evidence["split"] == "val" and f.evidence["kind"] == "leak"


def test_val_train_gap_healthy_and_a_train_loss_rise_are_quiet():
    assert drive(ValTrainGapDetector(ValTrainGapConfig()), gap_stream(300)) == []
    assert drive(ValTrainGapDetector(ValTrainGapConfig()), gap_stream(300, train_rise_at=150)) == []
