"""Loops without a ``torch.optim`` optimizer: ``rw.watch(model, optimizer=None)`` with a
hand-written SGD update. With ``before_optimizer_step()`` / ``after_optimizer_step()`` around the
update the step events carry the gradient, parameter and update norms (the update of plain SGD is
exactly lr x the gradient) and the LR given; without them, the loss, the step time and the norms
of the gradients still present at ``end_step``, and nothing crashes. An ActionListener whose
rollback has no optimizer restores the model and says the LR was not scaled."""

from __future__ import annotations

import math
import re
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from runwatch.contract.schema import Action, decode_event, utc_now
from runwatch.contract.signing import sign_action
from runwatch.producer import ActionListener, JsonlRecorder, save_checkpoint
from tests.support.action_keys import PUBLIC, WORKERS

LR = 0.1


def steps_of(path) -> list:
    return [e for e in (decode_event(line) for line in path.read_bytes().splitlines()) if e.kind == "step"]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(16, 6)
    return x, x.sum(dim=1, keepdim=True)


def sgd_(model: torch.nn.Module, lr: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def test_hand_written_sgd_with_explicit_calls_reports_grad_update_and_lr(tmp_path):
    rec = JsonlRecorder(tmp_path / "manual.jsonl", "manual", collect_metadata=False)
    model = make_model()
    watch = rec.watch(model, optimizer=None, update_every=1, memory=False, heartbeat_s=None)
    lr = LR
    for step in range(6):
        x, y = batch()
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        watch.before_optimizer_step()
        sgd_(model, lr)
        watch.after_optimizer_step()
        watch.end_step(loss, step=step, lr=lr, samples=len(x))
        if step == 3:
            lr /= 4  # annealed by hand, as older examples do
    rec.close()
    assert watch.errors == 0
    steps = steps_of(rec.path)
    assert [s.step for s in steps] == list(range(6))
    for s in steps:
        assert s.loss is not None and math.isfinite(s.loss)
        assert s.step_time_s is not None and s.step_time_s > 0
        assert s.grad_norm is not None and s.grad_norm > 0 and s.nonfinite_grads == 0
        assert set(s.module_grad_norms) == {"0", "2"}
        assert s.param_norm is not None and s.param_norm > 0
        assert s.update_norm is not None and s.relative_update_norm is not None
        # plain SGD: the update is lr x the gradient
        assert s.update_norm == pytest.approx(s.lr[0] * s.grad_norm, rel=1e-4)
        assert s.relative_update_norm == pytest.approx(s.update_norm / s.param_norm)
        assert s.effective_lr_ratio == pytest.approx(s.lr[0], rel=1e-4)
    assert [s.lr for s in steps] == [[LR]] * 4 + [[LR / 4]] * 2


def test_the_lr_option_and_clip_with_explicit_calls(tmp_path):
    rec = JsonlRecorder(tmp_path / "clip.jsonl", "manual-clip", collect_metadata=False)
    model = make_model()
    watch = rec.watch(model, None, lr=LR, clip=1e-3, update_every=2, memory=False, heartbeat_s=None)
    for _ in range(4):
        x, y = batch()
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        watch.before_optimizer_step()  # clips the gradients in place
        sgd_(model, LR)
        watch.after_optimizer_step()
        watch.end_step(1.0)
    rec.close()
    steps = steps_of(rec.path)
    assert all(s.lr == [LR] for s in steps)
    assert all(s.grad_norm > 1e-3 and s.grad_norm_clipped == pytest.approx(1e-3, rel=1e-3) for s in steps)
    assert [s.update_norm is not None for s in steps] == [True, False, True, False]  # every 2nd step
    assert steps[0].update_norm == pytest.approx(LR * 1e-3, rel=1e-3)  # the clipped gradient was applied


def test_without_the_calls_the_step_still_publishes_what_it_can(tmp_path, caplog):
    rec = JsonlRecorder(tmp_path / "bare.jsonl", "manual-bare", collect_metadata=False)
    model = make_model()
    watch = rec.watch(model, None, clip=1.0, update_every=1, memory=False, heartbeat_s=None)
    for step in range(4):
        x, y = batch()
        model.zero_grad(set_to_none=step < 2)  # the first two steps start with no gradients at all
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        sgd_(model, LR)
        if step == 3:
            model.zero_grad(set_to_none=True)  # gone before end_step: no gradient figures, no crash
        watch.end_step(loss)
    watch.close()
    rec.close()
    assert watch.errors == 0
    assert "did not clip" in caplog.text  # clip= asked for, which needs before_optimizer_step()
    steps = steps_of(rec.path)
    assert [s.step for s in steps] == [0, 1, 2, 3]
    assert all(s.loss is not None and s.step_time_s is not None for s in steps)
    assert all(s.lr == [] for s in steps)  # no optimizer and no lr given: none reported
    assert all(s.grad_norm is not None and s.grad_norm > 0 for s in steps[:3])
    assert all(s.grad_norm_clipped is None and s.clip_ratio is None for s in steps)
    assert steps[3].grad_norm is None
    assert all(s.update_norm is None for s in steps)


def test_a_rollback_with_no_optimizer_restores_the_model_and_leaves_the_lr(tmp_path):
    rec = JsonlRecorder(tmp_path / "rb.jsonl", "manual-rb", collect_metadata=False)
    model = make_model()
    watch = rec.watch(model, None, lr=LR, memory=False, heartbeat_s=None)
    listener = ActionListener(rec, model, None, public_keys=PUBLIC.text, consume=False, state_path=False)

    def train(step: int) -> None:
        x, y = batch()
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        watch.before_optimizer_step()
        sgd_(model, LR)
        watch.after_optimizer_step()
        watch.end_step(loss, step=step)

    train(0)
    save_checkpoint(str(tmp_path / "c1.pt"), model)  # no optimizer state to save
    rec.checkpoint(1, str(tmp_path / "c1.pt"))
    good = [p.detach().clone() for p in model.parameters()]
    for step in range(1, 5):
        train(step)
    issued = utc_now()
    rollback = sign_action(
        Action(
            action_id=uuid.uuid4().hex,
            run_id=rec.run_id,
            kind="rollback",
            reason="t",
            step=4,
            onset_step=3,
            params={"lr_scale": 0.5},
            issued_at=issued,
            expires_at=issued + timedelta(seconds=60),
        ),
        WORKERS,
    )
    listener._accept(rollback.to_json())
    [applied] = listener.poll(step=5)
    assert (applied.outcome, applied.to_step) == ("applied", 1)
    assert applied.lr_scale is None and "LR not scaled: no optimizer attached" in applied.detail
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), good, strict=True))
    train(5)  # the loop goes on after the rollback
    listener.close()
    rec.close()
    assert watch.errors == 0
    assert [s.step for s in steps_of(rec.path)] == [0, 1, 2, 3, 4, 5]


def test_the_documented_hand_written_loop_runs_as_it_stands(tmp_path):
    """docs/instrumenting.md's block, run with a recorder as ``rw`` and a small real model."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "instrumenting.md"
    mark = "<!-- executed by tests/producer/test_manual_update.py -->"
    [code] = re.findall(re.escape(mark) + r"\n```python\n(.*?)```", doc.read_text(), flags=re.S)
    rec = JsonlRecorder(tmp_path / "doc.jsonl", "manual-doc", collect_metadata=False)
    model = make_model()
    torch.manual_seed(1)
    batches = [batch() for _ in range(250)]
    scope = {
        "torch": torch,
        "rw": rec,
        "model": model,
        "criterion": torch.nn.functional.mse_loss,
        "batches": batches,
    }
    exec(compile(code, str(doc), "exec"), scope)
    rec.close()  # closes the watcher the block made, too
    assert scope["watch"].errors == 0
    steps = steps_of(rec.path)
    assert [s.step for s in steps] == list(range(250))
    assert all(s.grad_norm is not None and s.loss is not None for s in steps)
    assert [s.lr for s in steps[98:101]] == [[0.05], [0.05], [0.0125]]  # annealed by hand after step 99
    assert all(math.isfinite(s.loss) and math.isfinite(s.grad_norm) for s in steps)
    measured = [s for s in steps if s.update_norm is not None]
    assert [s.step for s in measured] == list(range(0, 250, 10))
    assert all(s.update_norm == pytest.approx(s.lr[0] * s.grad_norm, rel=1e-4) for s in measured)
