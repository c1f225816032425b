"""The trainer's side of actions without a broker: actions are handed to the listener as the
consumer thread would (signed bytes), and what it does is checked on a real torch model and
optimizer. Rollback restores and scales the LR relative to the scale the restored state carries;
the data window to skip follows the restored checkpoint; a pause blocks until a resume or its
timeout; a stop arms the hard-exit watchdog; every rank applies and acknowledges with its rank."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from runwatch.producer.actions import LR_SCALE_KEY, ActionListener, save_checkpoint, scale_lr
from runwatch.producer.heartbeat import Heartbeat
from runwatch.producer.publisher import TelemetryPublisher
from runwatch.producer.schema import Action, CheckpointRef, utc_now
from runwatch.producer.signing import sign_action

SECRET = "unit-secret"
REPO = Path(__file__).resolve().parents[2]


class RecordingPublisher(TelemetryPublisher):
    """A publisher that keeps its events: the listener's acks land here."""

    def __init__(self, run_id: str = "run-u", rank: int = 0):
        self.run_id = run_id
        self.rank = rank
        self.checkpoints: list[CheckpointRef] = []
        self.bootstrap = "unused:9092"
        self.events: list = []

    def publish(self, event) -> bool:  # noqa: ANN001
        self.events.append(event)
        return True

    def acks(self) -> list:
        return [e for e in self.events if e.kind == "action_ack"]


def action(kind: str, run_id: str = "run-u", *, onset: int = 15, step: int = 17, params: dict | None = None,
           target: CheckpointRef | None = None, secret: str = SECRET) -> Action:
    issued = utc_now()
    a = Action(action_id=uuid.uuid4().hex, run_id=run_id, kind=kind, reason="test", step=step, onset_step=onset,
               target_checkpoint=target, params=params or {}, issued_at=issued,
               expires_at=issued + timedelta(seconds=60))
    return sign_action(a, secret.encode())


def make(rw: RecordingPublisher, model=None, optimizer=None, **kw) -> ActionListener:  # noqa: ANN001
    return ActionListener(rw, model, optimizer, secret=SECRET, consume=False, **kw)


def deliver(listener: ActionListener, *actions: Action) -> None:
    for a in actions:
        listener._accept(a.to_json())


@pytest.fixture
def trained(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.02}],
                                momentum=0.9)

    def step() -> None:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return model, optimizer, step, tmp_path


def lrs(optimizer) -> list[float]:  # noqa: ANN001
    return [g["lr"] for g in optimizer.param_groups]


def test_rollback_restores_then_scales_every_param_group(trained):
    model, optimizer, step, tmp = trained
    rw = RecordingPublisher()
    listener = make(rw, model, optimizer)
    step()
    save_checkpoint(str(tmp / "c10.pt"), model, optimizer)
    rw.checkpoints.append(CheckpointRef(step=10, uri=str(tmp / "c10.pt")))
    good = model.weight.detach().clone()
    step()
    first = action("rollback", params={"lr_scale": 0.5, "skip_steps": [11, 17]})
    deliver(listener, first)
    [applied] = listener.poll(step=18)
    assert (applied.outcome, applied.to_step, applied.from_step) == ("applied", 10, 18)
    assert torch.equal(model.weight, good)
    assert lrs(optimizer) == pytest.approx([0.05, 0.01])
    assert (applied.lr_scale, applied.lr_factor) == (0.5, 0.5)
    assert applied.skip_steps == (11, 17) and applied.skips(11) and applied.skips(17) and not applied.skips(18)
    [ack] = rw.acks()
    assert (ack.action_id, ack.outcome, ack.to_step, ack.step, ack.rank) == (first.action_id, "applied", 10, 18, 0)
    assert "x0.5" in ack.detail and "11..17" in ack.detail

    # A checkpoint taken after the first rollback carries its scale; the second rollback (0.25 in
    # all) halves it once more, and going back to the pre-rollback checkpoint gives the same LR.
    step()
    save_checkpoint(str(tmp / "c14.pt"), model, optimizer)
    rw.checkpoints.append(CheckpointRef(step=14, uri=str(tmp / "c14.pt")))
    deliver(listener, action("rollback", onset=20, step=22, params={"lr_scale": 0.25}))
    [second] = listener.poll(step=23)
    assert second.to_step == 14 and second.lr_factor == 0.5 and second.skip_steps is None
    assert lrs(optimizer) == pytest.approx([0.025, 0.005])
    deliver(listener, action("rollback", onset=12, step=13, params={"lr_scale": 0.25}))
    [third] = listener.poll(step=24)
    assert third.to_step == 10 and third.lr_factor == 0.25  # the step-10 state carried no scale
    assert lrs(optimizer) == pytest.approx([0.025, 0.005])
    assert all(g[LR_SCALE_KEY] == 0.25 for g in optimizer.param_groups)


def test_skip_window_follows_the_checkpoint_actually_restored(trained):
    model, optimizer, _step, tmp = trained
    rw = RecordingPublisher()
    listener = make(rw, model, optimizer)
    save_checkpoint(str(tmp / "c4.pt"), model, optimizer)
    rw.checkpoints.append(CheckpointRef(step=4, uri=str(tmp / "c4.pt")))
    # the worker proposed a checkpoint this trainer never registered: it restores step 4 instead
    deliver(listener, action("rollback", params={"skip_steps": [9, 17]}, target=CheckpointRef(step=8, uri="/x")))
    [applied] = listener.poll(step=18)
    assert applied.to_step == 4 and applied.skip_steps == (5, 17)
    assert applied.lr_scale is None and lrs(optimizer) == [0.1, 0.02]  # no lr_scale in the action


def test_lr_scale_without_an_optimizer_is_reported_not_applied(tmp_path):
    model = torch.nn.Linear(2, 1)
    rw = RecordingPublisher()
    listener = make(rw, model)
    save_checkpoint(str(tmp_path / "c.pt"), model)
    rw.checkpoints.append(CheckpointRef(step=1, uri=str(tmp_path / "c.pt")))
    deliver(listener, action("rollback", params={"lr_scale": 0.5}))
    [applied] = listener.poll(step=18)
    assert applied.outcome == "applied" and applied.lr_scale is None
    assert "no optimizer attached" in applied.detail


def test_scale_lr_keeps_a_tensor_lr_a_tensor():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    lr = opt.param_groups[0]["lr"]
    assert scale_lr(opt, 0.5) == 0.5
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.005)


def test_a_rank_that_registered_no_checkpoint_restores_the_target_and_acks_with_its_rank(trained):
    model, optimizer, step, tmp = trained
    rank0 = RecordingPublisher(rank=0)
    rank3 = RecordingPublisher(rank=3)  # rank 0 saves and registers; rank 3 only restores
    save_checkpoint(str(tmp / "c10.pt"), model, optimizer)
    ref = CheckpointRef(step=10, uri=str(tmp / "c10.pt"))
    rank0.checkpoints.append(ref)
    good = model.weight.detach().clone()
    step()
    rollback = action("rollback", target=ref, params={"lr_scale": 0.5})
    results = []
    for rw in (rank0, rank3):
        listener = make(rw, model, optimizer)
        deliver(listener, rollback)
        results += listener.poll(step=18)
        assert torch.equal(model.weight, good)
        step()
    assert [(r.outcome, r.to_step) for r in results] == [("applied", 10), ("applied", 10)]
    assert [(a.rank, a.action_id) for a in rank0.acks() + rank3.acks()] == [(0, rollback.action_id),
                                                                            (3, rollback.action_id)]


def test_forged_and_foreign_actions_are_not_applied():
    rw = RecordingPublisher()
    listener = make(rw)
    deliver(listener, action("stop", secret="wrong"), action("stop", run_id="other-run"))
    assert listener.poll(step=1) == [] and dict(listener.ignored) == {"bad_signature": 1}
    assert rw.acks() == []


def test_pause_blocks_until_resume_then_applies_what_came_meanwhile_in_order():
    rw = RecordingPublisher()
    heartbeat = Heartbeat(rw, interval_s=60)  # not started: phase changes only
    listener = make(rw, heartbeat=heartbeat)
    pause, alert, resume = action("pause"), action("alert"), action("resume")
    deliver(listener, pause)
    phases = []

    def later() -> None:
        time.sleep(0.3)
        phases.append(heartbeat.current[1])
        deliver(listener, alert, resume)

    threading.Thread(target=later).start()
    started = time.monotonic()
    results = listener.poll(step=5)
    assert 0.25 < time.monotonic() - started < 5
    assert [r.kind for r in results] == ["pause", "alert", "resume"]
    assert phases == ["idle"] and heartbeat.current[1] == "train"
    assert f"until resume {resume.action_id}" in results[0].detail
    assert results[2].detail == f"ended pause {pause.action_id}"
    assert [a.action_id for a in rw.acks()] == [pause.action_id, alert.action_id, resume.action_id]
    assert listener.poll(step=6) == []


def test_pause_times_out_and_a_stop_ends_it_too():
    rw = RecordingPublisher()
    listener = make(rw, pause_timeout_s=0.2)
    deliver(listener, action("pause"))
    [timed_out] = listener.poll(step=1)
    assert "timed out" in timed_out.detail and timed_out.outcome == "applied"

    deliver(listener, action("pause", params={"timeout_s": 30}))
    stop = action("stop")
    threading.Timer(0.2, deliver, (listener, stop)).start()
    results = listener.poll(step=2)
    assert [r.kind for r in results] == ["pause", "stop"]
    assert "until stop" in results[0].detail


CHILD = textwrap.dedent("""
    import sys, time, uuid
    from datetime import timedelta
    sys.path.insert(0, {tests!r})
    from unit.test_actions_unit import RecordingPublisher, action, deliver
    from runwatch.producer.actions import ActionListener

    listener = ActionListener(RecordingPublisher(), secret={secret!r}, consume=False,
                              stop_exit_after_s=1.0, stop_exit_code=7)
    deliver(listener, action("stop"))
    [applied] = listener.poll(step=3)
    assert applied.kind == "stop"
    print("stop received", flush=True)
    if sys.argv[1] == "hang":
        time.sleep(60)  # the graceful path never finishes (a stuck collective, a hung save)
    """)


@pytest.mark.parametrize("mode", ["hang", "graceful"])
def test_stop_watchdog_hard_exits_a_process_that_does_not_exit(mode):
    code = CHILD.format(tests=str(REPO / "tests"), secret=SECRET)
    started = time.monotonic()
    child = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=30)
    elapsed = time.monotonic() - started
    assert "stop received" in child.stdout, child.stderr
    if mode == "hang":
        assert child.returncode == 7 and elapsed < 20
        assert "exiting with code 7" in child.stderr
    else:  # a process that exits by itself is not held up by the watchdog
        assert child.returncode == 0 and "exiting with code" not in child.stderr
