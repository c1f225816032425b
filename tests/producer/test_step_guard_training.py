"""Issue 37, end to end: real torch training (``fault_train.py``), the real broker and the session's
default-config worker.

- one NaN batch: the step guard skips that update; no weight is ever non-finite, no rollback;
- a NaN in every batch from a step: the guard holds the weights, and the worker asks for a rollback
  after 3 skips in a row;
- a NaN tied to a batch, the guard off: one rollback, the batch's window skipped (the data goes on
  forward), the run back within 5% of a healthy twin's validation loss, no stop;
- a loop whose LR a scheduler sets every step: after a rollback (scale 0.5) the LR its updates use is
  half the schedule's for the healthy steps the policy says, then returns to the schedule.
"""

from __future__ import annotations

import math

import pytest

from tests.worker.test_trusted_rollback import BASE_LR, train  # noqa: F401 - the fixture

pytestmark = pytest.mark.integration

STEPS = 900


def _kinds(result: dict) -> list[str]:
    return [a["kind"] for a in result["applied"] if a["kind"] not in ("alert", "recovered")]


def test_one_nan_batch_is_skipped_before_it_lands_and_needs_no_rollback(worker, train):  # noqa: F811
    result = train("nan_batch:150", steps=260).finish()
    assert result["status"] == "completed"
    assert result["nonfinite_weights"] == []  # read after every step: no weight ever held a NaN
    assert result["skipped"] == {"nonfinite": 1, "grad_spike": 0}
    assert _kinds(result) == [], result["applied"]


def test_a_nan_in_every_batch_is_held_off_the_weights_and_rolled_back_after_three_skips(
    worker,
    train,  # noqa: F811
):
    run = train("nan_from:150", steps=260)
    result = run.finish()
    assert result["nonfinite_weights"] == []
    assert _kinds(result)[0] == "rollback", result["applied"]
    rollback = next(
        a for a in run.actions(lambda got: any(a.kind == "rollback" for a in got)) if a.kind == "rollback"
    )
    assert (rollback.onset_step, rollback.step) == (150, 152)  # the third update skipped in a row
    causes = {
        a.detector for a in run.anomalies(lambda got: len(got) >= 2) if a.anomaly_id in rollback.anomaly_ids
    }
    assert causes & {"skipped_updates", "non_finite"}


def test_a_nan_tied_to_a_batch_is_rolled_back_once_and_not_replayed(worker, train):  # noqa: F811
    # long enough for the rollback's LR cut to return (500 healthy steps, then 100); 10% random labels
    # give the task a loss floor, as real data has (its entropy): the twins are compared near it
    noise = ("--label-noise", "0.1")
    healthy = train("none", steps=STEPS, step_sleep=0.002, args=noise)
    faulty = train("nan_batch:150", steps=STEPS, step_sleep=0.002, args=("--no-guard", *noise))
    good, result = healthy.finish(), faulty.finish()
    assert result["status"] == "completed", result["applied"]
    assert _kinds(result) == ["rollback"], result["applied"]
    (rollback,) = [a for a in result["applied"] if a["kind"] == "rollback"]
    first, last = rollback["skip"]
    assert first == rollback["to_step"] + 1 and last >= 150
    assert f"skip the batches of steps {first}..{last}" in rollback["detail"]
    trained_on = [result["batches"][str(s)] for s in range(rollback["to_step"] + 1, STEPS)]
    assert 150 not in trained_on and trained_on[0] == last + 1  # the data went on forward
    print({"val_loss": result["val_loss"], "healthy_val_loss": good["val_loss"]})
    assert result["val_loss"] <= good["val_loss"] * 1.05, (result["val_loss"], good["val_loss"])


def test_the_rollback_lr_holds_through_a_scheduler_and_returns_after_the_healthy_steps(
    worker,
    train,  # noqa: F811
):
    result = train("nan:100", steps=760, step_sleep=0.005, args=("--schedule", "cosine")).finish()
    assert result["status"] == "completed", result["applied"]
    (rollback,) = [a for a in result["applied"] if a["kind"] == "rollback"]
    assert rollback["lr_scale"] == 0.5
    back = rollback["to_step"] + 1
    ratio = {int(s): lr / result["schedule_lrs"][s] for s, lr in result["lrs"].items()}
    # the LR the updates used: half the schedule for the next 100 steps (and up to the 500th healthy one)
    assert [ratio[s] for s in range(back, back + 100)] == pytest.approx([0.5] * 100)
    assert [ratio[s] for s in range(back + 100, back + 500)] == pytest.approx([0.5] * 400)
    # then back to the schedule over 100 steps, and on it
    returning = [ratio[s] for s in range(back + 500, back + 600)]
    assert returning == sorted(returning) and 0.5 < returning[0] < returning[-1] == pytest.approx(1.0)
    assert [ratio[s] for s in range(back + 600, 760)] == pytest.approx([1.0] * (160 - back))
    # the schedule itself went on as planned: at the end it is the cosine's, not halved
    assert result["schedule_lrs"]["759"] == pytest.approx(
        BASE_LR * (0.1 + 0.45 * (1 + math.cos(math.pi * 759 / 760)))
    )
