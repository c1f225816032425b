"""The trainer's side of actions without a broker: actions are handed to the listener as the
consumer thread would (signed bytes), and what it does is checked on a real torch model and
optimizer. Rollback restores and scales the LR relative to the scale the restored state carries;
the data window to skip follows the restored checkpoint; a pause blocks until a resume or its
timeout; a stop arms the hard-exit watchdog; every rank applies and acknowledges with its rank.
Poison: a signed action dated in the future is ignored, an action applied before a restart is not
applied again (the per-rank state file, bounded), and every ignored action is counted by reason."""

from __future__ import annotations

import json
import logging
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

from runwatch.contract.schema import Action, CheckpointRef, utc_now
from runwatch.contract.signing import ActionSigningKey, MissingKeyError, sign_action
from runwatch.producer import MemoryDelivery
from runwatch.producer.actions.applied_ids import AppliedIds, default_state_path
from runwatch.producer.actions.checkpoints import save_checkpoint
from runwatch.producer.actions.listener import ActionListener
from runwatch.producer.instrument.heartbeat import Heartbeat
from runwatch.producer.publish.lr import LR_SCALE_KEY, restore_base_lr
from runwatch.producer.publish.lr_hold import LRHold, held_scale
from runwatch.producer.publish.run_watch import RunWatch
from tests.support.action_keys import PUBLIC, WORKERS

PUBLIC_KEYS = PUBLIC.text  # what a trainer holds: $RUNWATCH_ACTION_PUBLIC_KEYS
OTHER_KEY = ActionSigningKey.generate()  # not the workers'
REPO = Path(__file__).resolve().parents[2]


class RecordingPublisher(RunWatch):
    """A RunWatch that keeps its events: the listener's acks land here."""

    def __init__(self, run_id: str = "run-u", rank: int = 0):
        super().__init__(
            run_id,
            "unused:9092",
            rank=rank,
            world_size=rank + 1,
            collect_metadata=False,
            delivery=MemoryDelivery(),
        )

    @property
    def events(self) -> list:
        return self.delivery.events

    def acks(self) -> list:
        return [e for e in self.events if e.kind == "action_ack"]


def action(
    kind: str,
    run_id: str = "run-u",
    *,
    onset: int = 15,
    step: int = 17,
    params: dict | None = None,
    target: CheckpointRef | None = None,
    signed_by: ActionSigningKey = WORKERS,
    issued_delta_s: float = 0,
) -> Action:
    issued = utc_now() + timedelta(seconds=issued_delta_s)
    a = Action(
        action_id=uuid.uuid4().hex,
        run_id=run_id,
        kind=kind,
        reason="test",
        step=step,
        onset_step=onset,
        target_checkpoint=target,
        params=params or {},
        issued_at=issued,
        expires_at=issued + timedelta(seconds=60),
    )
    return sign_action(a, signed_by)


def make(rw: RecordingPublisher, model=None, optimizer=None, **kw) -> ActionListener:
    return ActionListener(rw, model, optimizer, public_keys=PUBLIC_KEYS, consume=False, **kw)


def deliver(listener: ActionListener, *actions: Action) -> None:
    for a in actions:
        listener._accept(a.to_json())


@pytest.fixture
def trained(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(
        [{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.02}], momentum=0.9
    )

    def step() -> None:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return model, optimizer, step, tmp_path


def lrs(optimizer) -> list[float]:
    return [g["lr"] for g in optimizer.param_groups]


def used_lrs(optimizer) -> list[float]:
    """The LRs an update uses now, read inside a real ``optimizer.step()`` (after runwatch's hold)."""
    seen: list[list[float]] = []
    handle = optimizer.register_step_pre_hook(lambda o, _a, _k: seen.append([float(x) for x in lrs(o)]))
    grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
    for g in optimizer.param_groups:
        for p in g["params"]:
            p.grad = None  # (no update: only the LR is read)
    optimizer.step()
    handle.remove()
    for p, grad in zip([p for g in optimizer.param_groups for p in g["params"]], grads, strict=True):
        p.grad = grad
    return seen[0]


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
    assert used_lrs(optimizer) == pytest.approx([0.05, 0.01])
    assert lrs(optimizer) == pytest.approx([0.1, 0.02])  # the loop's own LR: the scale is held in the step
    assert (applied.lr_scale, applied.lr_factor) == (0.5, 0.5)
    assert (
        applied.skip_steps == (11, 17) and applied.skips(11) and applied.skips(17) and not applied.skips(18)
    )
    [ack] = rw.acks()
    assert (ack.action_id, ack.outcome, ack.to_step, ack.step, ack.rank) == (
        first.action_id,
        "applied",
        10,
        18,
        0,
    )
    assert "x0.5" in ack.detail and "11..17" in ack.detail

    # A checkpoint taken after the first rollback holds the run's own LR (the scale is held in the step,
    # not written into it); the second rollback (0.25 in all) quarters it, and going back to the
    # pre-rollback checkpoint gives the same LR.
    step()
    save_checkpoint(str(tmp / "c14.pt"), model, optimizer)
    rw.checkpoints.append(CheckpointRef(step=14, uri=str(tmp / "c14.pt")))
    deliver(listener, action("rollback", onset=20, step=22, params={"lr_scale": 0.25}))
    [second] = listener.poll(step=23)
    assert second.to_step == 14 and second.lr_factor == 0.25 and second.skip_steps is None
    assert used_lrs(optimizer) == pytest.approx([0.025, 0.005])
    deliver(listener, action("rollback", onset=12, step=13, params={"lr_scale": 0.25}))
    [third] = listener.poll(step=24)
    assert third.to_step == 10 and third.lr_factor == 0.25
    assert used_lrs(optimizer) == pytest.approx([0.025, 0.005])
    assert held_scale(optimizer) == 0.25 and all(g[LR_SCALE_KEY] == 1.0 for g in optimizer.param_groups)


def test_skip_window_follows_the_checkpoint_actually_restored(trained):
    model, optimizer, _step, tmp = trained
    rw = RecordingPublisher()
    listener = make(rw, model, optimizer)
    save_checkpoint(str(tmp / "c4.pt"), model, optimizer)
    rw.checkpoints.append(CheckpointRef(step=4, uri=str(tmp / "c4.pt")))
    # the worker proposed a checkpoint this trainer never registered: it restores step 4 instead
    deliver(
        listener, action("rollback", params={"skip_steps": [9, 17]}, target=CheckpointRef(step=8, uri="/x"))
    )
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


def test_a_tensor_lr_stays_a_tensor():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    lr = opt.param_groups[0]["lr"]
    lr.fill_(0.5)  # the fault, in the optimizer state
    assert restore_base_lr(opt, 0.5, base=[0.01]) == pytest.approx(0.01)
    hold = LRHold.of(opt)
    assert hold is not None
    hold.hold(0.5)
    assert used_lrs(opt) == pytest.approx([0.005])
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.01)


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
    assert [(a.rank, a.action_id) for a in rank0.acks() + rank3.acks()] == [
        (0, rollback.action_id),
        (3, rollback.action_id),
    ]


def test_forged_and_foreign_actions_are_not_applied():
    rw = RecordingPublisher()
    listener = make(rw)
    deliver(listener, action("stop", signed_by=OTHER_KEY), action("stop", run_id="other-run"))
    assert listener.poll(step=1) == [] and dict(listener.ignored) == {"bad_signature": 1, "other_run": 1}
    assert rw.acks() == []


def test_pause_blocks_until_resume_then_applies_what_came_meanwhile_in_order():
    rw = RecordingPublisher()
    heartbeat = Heartbeat(rw, interval_s=60)  # not started: phase changes only
    listener = make(rw, heartbeat=heartbeat)
    pause, alert, resume = action("pause"), action("alert"), action("resume")
    deliver(listener, pause)
    phases = []

    def later() -> None:
        # once the loop is held (the pause shows as "idle"), not after a guessed delay
        deadline = time.monotonic() + 30
        while heartbeat.current[1] != "idle" and time.monotonic() < deadline:
            time.sleep(0.005)
        phases.append(heartbeat.current[1])
        deliver(listener, alert, resume)

    threading.Thread(target=later).start()
    results = listener.poll(step=5)  # returns only when the resume has come
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
    sys.path.insert(0, {repo!r})
    from tests.producer.test_actions_unit import RecordingPublisher, action, deliver
    from runwatch.producer.actions.listener import ActionListener

    listener = ActionListener(RecordingPublisher(), public_keys={public_keys!r}, consume=False,
                              stop_exit_after_s=1.0, stop_exit_code=7)
    deliver(listener, action("stop"))
    [applied] = listener.poll(step=3)
    assert applied.kind == "stop"
    print("stop received", flush=True)
    if sys.argv[1] == "hang":
        time.sleep(60)  # the graceful path never finishes (a stuck collective, a hung save)
    """)


@pytest.mark.integration  # starts a process
@pytest.mark.parametrize("mode", ["hang", "graceful"])
def test_stop_watchdog_hard_exits_a_process_that_does_not_exit(mode):
    code = CHILD.format(repo=str(REPO), public_keys=PUBLIC_KEYS)
    started = time.monotonic()
    child = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=30)
    elapsed = time.monotonic() - started
    assert "stop received" in child.stdout, child.stderr
    if mode == "hang":
        assert child.returncode == 7 and elapsed < 20
        assert "exiting with code 7" in child.stderr
    else:  # a process that exits by itself is not held up by the watchdog
        assert child.returncode == 0 and "exiting with code" not in child.stderr


# -- poison: future-dated, redelivered after a restart, other runs' -------------------------------


def test_a_signed_action_dated_in_the_future_is_ignored_and_counted():
    rw = RecordingPublisher()
    listener = make(rw, state_path=False)
    future = action("stop", issued_delta_s=2 * 3600)  # validly signed, and not even expired
    assert utc_now() < future.expires_at
    deliver(listener, future)
    assert listener.poll(step=1) == [] and dict(listener.ignored) == {"future": 1}
    assert rw.acks() == [] and listener.watchdog.thread is None  # not even the stop watchdog was armed
    # Within the clock-skew allowance (30 s, the one that takes actions issued before the start) it is
    # applied.
    skewed = action("alert", issued_delta_s=20)
    deliver(listener, skewed)
    assert [a.action.action_id for a in listener.poll(step=2)] == [skewed.action_id]
    # The allowance is the listener's clock_skew_s
    strict = make(RecordingPublisher(), state_path=False, clock_skew_s=5)
    deliver(strict, action("alert", issued_delta_s=20), action("alert", issued_delta_s=-20))
    assert strict.poll(step=1) == [] and dict(strict.ignored) == {"future": 1, "stale": 1}


def test_a_restarted_listener_with_the_same_state_file_does_not_apply_again(tmp_path):
    state = tmp_path / "ckpt" / "rank0.actions"  # a directory that does not exist yet
    stop, rollback = action("stop"), action("rollback")  # no checkpoint registered: the rollback fails
    first_rw = RecordingPublisher()
    first = make(first_rw, state_path=state)
    deliver(first, rollback, stop)
    assert [(a.kind, a.outcome) for a in first.poll(step=5)] == [("rollback", "failed"), ("stop", "applied")]
    assert json.loads(state.read_text())["applied"] == [rollback.action_id, stop.action_id]
    first.close()

    # The trainer restarts 5 s later: both actions are within the start-time allowance, and come again.
    restarted_rw = RecordingPublisher()
    restarted = make(restarted_rw, state_path=str(state))
    deliver(restarted, rollback, stop, stop)
    assert restarted.poll(step=0) == [] and restarted_rw.acks() == []
    assert dict(restarted.ignored) == {"already_applied": 3}
    fresh = action("alert")  # a new action is applied as ever, and kept too
    deliver(restarted, fresh)
    assert [a.action.action_id for a in restarted.poll(step=1)] == [fresh.action_id]
    assert json.loads(state.read_text())["applied"][-1] == fresh.action_id

    # The control: without the state file the same redelivery is applied again.
    forgetful = make(RecordingPublisher(), state_path=False)
    deliver(forgetful, stop)
    assert [a.kind for a in forgetful.poll(step=0)] == ["stop"]
    assert not list(tmp_path.glob("**/*.tmp-*"))  # atomic writes leave no temporary file behind


def test_the_default_state_file_is_per_rank_beside_the_spool(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNWATCH_SPOOL_DIR", str(tmp_path))
    stop = action("stop")
    rank0, rank1 = RecordingPublisher(rank=0), RecordingPublisher(rank=1)
    assert default_state_path(rank0) == tmp_path.resolve() / "run-u-r0.actions"
    first = make(rank0)
    deliver(first, stop)
    assert [a.kind for a in first.poll(step=1)] == ["stop"]
    assert json.loads((tmp_path / "run-u-r0.actions").read_text()) == {
        "run_id": "run-u",
        "rank": 0,
        "applied": [stop.action_id],
    }
    other_rank = make(rank1)  # its own file: what rank 0 applied says nothing about rank 1
    deliver(other_rank, stop)
    assert [a.kind for a in other_rank.poll(step=1)] == ["stop"]
    again = make(RecordingPublisher(rank=0))
    deliver(again, stop)
    assert again.poll(step=1) == [] and dict(again.ignored) == {"already_applied": 1}
    # A RunWatch's own spool directory is the anchor when it has one.
    rw = RecordingPublisher()
    rw.spool_path = tmp_path / "elsewhere" / "spool"
    assert default_state_path(rw) == tmp_path / "elsewhere" / "spool.actions"


def test_the_state_file_keeps_only_the_newest_ids(tmp_path):
    path = tmp_path / "ids.actions"
    ids = AppliedIds(path, max_ids=5)
    for i in range(8):
        ids.add(f"a{i}")
    assert json.loads(path.read_text())["applied"] == ["a3", "a4", "a5", "a6", "a7"]
    assert AppliedIds(path, max_ids=5).ids() == ["a3", "a4", "a5", "a6", "a7"]
    assert AppliedIds(path, max_ids=2).ids() == ["a6", "a7"]  # a smaller bound keeps the newest

    state = tmp_path / "listener.actions"
    listener = make(RecordingPublisher(), state_path=state, state_max_ids=3)
    alerts = [action("alert") for _ in range(5)]
    for a in alerts:
        deliver(listener, a)
    assert len(listener.poll(step=1)) == 5
    assert json.loads(state.read_text())["applied"] == [a.action_id for a in alerts[2:]]
    restarted = make(RecordingPublisher(), state_path=state, state_max_ids=3)
    deliver(restarted, *alerts)
    # only the oldest, evicted from the bounded file, would be applied again
    assert [a.action.action_id for a in restarted.poll(step=1)] == [a.action_id for a in alerts[:2]]
    assert restarted.ignored["already_applied"] == 3
    with pytest.raises(ValueError):
        AppliedIds(path, max_ids=0)


def test_an_unreadable_or_unwritable_state_file_never_stops_training(tmp_path, caplog):
    state = tmp_path / "bad.actions"
    state.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="runwatch.producer.actions.applied_ids"):
        listener = make(RecordingPublisher(), state_path=state)
    assert listener.applied_ids.errors == 1 and "cannot read" in caplog.text
    stop = action("stop")
    deliver(listener, stop)
    assert [a.kind for a in listener.poll(step=1)] == ["stop"]
    assert json.loads(state.read_text())["applied"] == [stop.action_id]  # rewritten whole

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runwatch.producer.actions.applied_ids"):
        # its parent is a file
        unwritable = make(RecordingPublisher(), state_path=blocked / "sub" / "x.actions")
        deliver(unwritable, action("alert"))
        assert [a.kind for a in unwritable.poll(step=1)] == ["alert"]
    assert unwritable.applied_ids.errors == 2  # read, then write
    assert "cannot write" in caplog.text and "may apply them again" in caplog.text


def test_every_ignored_action_is_counted_by_reason_and_none_stops_the_consumer():
    rw = RecordingPublisher()
    listener = make(rw, state_path=False)
    first = action("alert")
    naive = action("stop").model_copy(
        update={
            "issued_at": utc_now().replace(tzinfo=None),
            "expires_at": (utc_now() + timedelta(seconds=60)).replace(tzinfo=None),
        }
    )
    naive = sign_action(naive, WORKERS)
    deliver(
        listener,
        action("stop", run_id="other-run"),
        action("alert", run_id="another", signed_by=OTHER_KEY),
        action("stop", signed_by=OTHER_KEY),
        action("stop", issued_delta_s=3600),
        action("stop", issued_delta_s=-120),  # expired
        action("stop", issued_delta_s=-50),  # issued before the start (minus 30 s), not expired yet
        first,
        first,
    )
    listener._accept(None)  # a null value
    listener._accept(b"\xff\x00")
    listener._accept(naive.to_json())  # a timestamp without a timezone: refused, never raised
    assert [a.action.action_id for a in listener.poll(step=1)] == [first.action_id]
    assert dict(listener.ignored) == {
        "other_run": 2,
        "bad_signature": 1,
        "future": 1,
        "expired": 1,
        "stale": 1,
        "duplicate": 1,
        "malformed": 3,
    }


# -- issue 23, cases 2 and 3: a requeued trainer applies only its own attempt's actions ---------------


def _for_attempt(kind: str, attempt: str | None) -> Action:
    a = action(kind).model_copy(update={"attempt": attempt, "signature": ""})
    return sign_action(a, WORKERS)


def test_a_restarted_trainer_refuses_the_stop_issued_for_its_previous_attempt(monkeypatch):
    monkeypatch.delenv("RUNWATCH_ATTEMPT", raising=False)
    rw = RecordingPublisher()
    start = next(e for e in rw.events if e.kind == "run_start")
    assert rw.attempt and start.attempt == rw.attempt  # rank 0 names a new attempt in its run_start
    listener = make(rw)
    # issued seconds ago (within the clock-skew allowance) for the attempt that was killed
    deliver(listener, _for_attempt("alert", "previous"), _for_attempt("stop", "previous"))
    assert listener.poll(step=1) == [] and listener.ignored["other_attempt"] == 2
    assert rw.stopped_by is None
    deliver(listener, _for_attempt("alert", rw.attempt), _for_attempt("alert", None))
    assert [r.kind for r in listener.poll(step=2)] == ["alert", "alert"]


def test_the_attempt_comes_from_the_environment_on_every_rank(monkeypatch):
    monkeypatch.setenv("RUNWATCH_ATTEMPT", "slurm-81234-requeue-2")
    assert RecordingPublisher().attempt == RecordingPublisher(rank=3).attempt == "slurm-81234-requeue-2"
    monkeypatch.delenv("RUNWATCH_ATTEMPT")
    assert RecordingPublisher(rank=3).attempt is None  # rank 0 decides for it when ranks apply in step
    first, second = RecordingPublisher(), RecordingPublisher()
    assert first.attempt != second.attempt  # every launch is a new attempt


def test_a_listener_on_a_recorded_run_reads_no_kafka(tmp_path):
    from runwatch.producer import JsonlRecorder

    with JsonlRecorder(tmp_path / "run.jsonl", "recorded", collect_metadata=False) as rw:
        listener = ActionListener(rw, public_keys=PUBLIC_KEYS)
        assert listener._reader is None  # nothing connects to $RUNWATCH_BOOTSTRAP or 127.0.0.1:9092
        assert listener.poll(step=1) == []
    rw_memory = RecordingPublisher()
    assert ActionListener(rw_memory, public_keys=PUBLIC_KEYS)._reader is None  # nor on a run kept in memory


def test_without_a_public_key_the_listener_warns_once_and_the_run_goes_on_unwatched(monkeypatch, caplog):
    monkeypatch.delenv("RUNWATCH_ACTION_PUBLIC_KEYS", raising=False)
    rw = RecordingPublisher()
    with caplog.at_level("WARNING", logger="runwatch.producer.actions.listener"):
        listener = ActionListener(rw)  # no exception inside the training loop's `with`
    assert [r.getMessage() for r in caplog.records] == [
        f"runwatch: {listener.unsigned}; actions are not applied in this run"
    ]
    assert "RUNWATCH_ACTION_PUBLIC_KEYS" in (listener.unsigned or "")
    deliver(listener, action("rollback"))  # signed by the workers, whose public key this run does not have
    assert listener.poll(step=1) == [] and rw.acks() == []
    with pytest.raises(MissingKeyError):
        ActionListener(rw, strict=True)
    with pytest.raises(MissingKeyError, match="not base64"):
        ActionListener(rw, public_keys="ed25519:short", strict=True)
    with pytest.raises(MissingKeyError, match="private key"):  # never the workers' key on the training side
        ActionListener(rw, public_keys=WORKERS.pem().decode(), strict=True)


def test_the_first_action_of_this_run_that_fails_verification_is_warned_about_once(caplog):
    """A trainer whose public key is not the workers' (issue 35: a wrong key was silent) says so at the
    first such action of its own run, once; another run's actions and good ones say nothing."""
    rw = RecordingPublisher()
    listener = make(rw, state_path=False)
    with caplog.at_level("WARNING", logger="runwatch.producer.actions.listener"):
        deliver(listener, action("alert", run_id="another", signed_by=OTHER_KEY), action("alert"))
        assert caplog.records == [] and not listener.verification_warned
        deliver(listener, *(action("rollback", signed_by=OTHER_KEY) for _ in range(3)))
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(
        "runwatch: actions for run run-u fail verification: "
        "is RUNWATCH_ACTION_PUBLIC_KEYS the workers' public key?"
    )
    assert OTHER_KEY.key_id in warning and WORKERS.key_id in warning
    assert listener.ignored["bad_signature"] == 3 and [r.kind for r in listener.poll(step=1)] == ["alert"]
