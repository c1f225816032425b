"""Honest run ends: ``run_end`` says ``stopped`` (with the stop action's id and cause) after the
ActionListener applied a stop, ``failed`` when the training loop raised, ``interrupted`` on Ctrl-C,
``completed`` otherwise; an explicit status given to ``close()`` wins. Checked on the JSONL recorder
and on a ``RunWatch`` with no broker, whose events land in its disk spool (read back here)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import torch

from runwatch.contract.schema import Action, decode_event, utc_now
from runwatch.contract.signing import sign_action
from runwatch.producer import ActionListener, JsonlRecorder, RunWatch
from runwatch.producer.publish.spool import DiskSpool
from tests.support.action_keys import PUBLIC, WORKERS

NO_BROKER = "127.0.0.1:1"


def stop_action(run_id: str, params: dict | None = None) -> Action:
    issued = utc_now()
    a = Action(
        action_id=uuid.uuid4().hex,
        run_id=run_id,
        kind="stop",
        reason="test",
        step=7,
        onset_step=5,
        params=params or {},
        issued_at=issued,
        expires_at=issued + timedelta(seconds=60),
    )
    return sign_action(a, WORKERS)


def apply_stop(rw, params: dict | None = None) -> Action:
    """Hand a signed stop to a listener as its consumer would, and poll it as the loop does."""
    listener = ActionListener(rw, public_keys=PUBLIC.text, consume=False, state_path=False)
    action = stop_action(rw.run_id, params)
    listener._accept(action.to_json())
    [applied] = listener.poll(step=8)
    assert applied.kind == "stop" and applied.outcome == "applied"
    listener.close()
    return action


def recorded(path) -> list:
    return [decode_event(line) for line in path.read_bytes().splitlines()]


def run_end_of(path):
    events = recorded(path)
    assert events[-1].kind == "run_end" and [e.kind for e in events].count("run_end") == 1
    return events[-1]


def recorder(tmp_path, name: str = "run") -> JsonlRecorder:
    return JsonlRecorder(tmp_path / f"{name}.jsonl", f"end-{name}", collect_metadata=False)


def test_close_after_an_applied_stop_says_stopped_with_the_action_and_its_cause(tmp_path):
    rec = recorder(tmp_path)
    rec.step(0, loss=1.0)
    action = apply_stop(rec, {"cause": "loss_spike"})
    rec.close()
    end = run_end_of(rec.path)
    assert end.status == "stopped"
    assert end.summary == {"stop_action_id": action.action_id, "stop_cause": "loss_spike"}
    ack = next(e for e in recorded(rec.path) if e.kind == "action_ack")
    assert ack.action_id == action.action_id  # the stop was acknowledged as usual


def test_a_stop_without_a_cause_says_stop_and_extra_summary_is_kept(tmp_path):
    rec = recorder(tmp_path)
    action = apply_stop(rec)
    rec.close(summary={"steps": 8})
    end = run_end_of(rec.path)
    assert end.status == "stopped"
    assert end.summary == {"stop_action_id": action.action_id, "stop_cause": "stop", "steps": 8}


def test_an_explicit_status_still_wins(tmp_path):
    rec = recorder(tmp_path)
    apply_stop(rec, {"cause": "x"})
    rec.close(status="completed", summary={"note": "finished anyway"})
    end = run_end_of(rec.path)
    assert end.status == "completed" and end.summary == {"note": "finished anyway"}


def test_without_a_stop_close_says_completed(tmp_path):
    rec = recorder(tmp_path)
    rec.close()
    assert run_end_of(rec.path).status == "completed"


def test_other_actions_do_not_make_the_run_stopped(tmp_path):
    rec = recorder(tmp_path)
    listener = ActionListener(rec, public_keys=PUBLIC.text, consume=False, state_path=False)
    issued = utc_now()
    alert = sign_action(
        Action(
            action_id=uuid.uuid4().hex,
            run_id=rec.run_id,
            kind="alert",
            reason="t",
            step=3,
            issued_at=issued,
            expires_at=issued + timedelta(seconds=60),
        ),
        WORKERS,
    )
    listener._accept(alert.to_json())
    assert [a.kind for a in listener.poll(step=3)] == ["alert"]
    listener.close()
    rec.close()
    assert run_end_of(rec.path).status == "completed"


def test_with_block_completed_failed_interrupted_and_stopped(tmp_path):
    with recorder(tmp_path, "ok") as rec:
        rec.step(0, loss=1.0)
    assert run_end_of(rec.path).status == "completed"

    with pytest.raises(RuntimeError, match="the loss went to NaN"), recorder(tmp_path, "boom") as rec:
        rec.step(0, loss=1.0)
        raise RuntimeError("the loss went to NaN " + "x" * 2000)  # not swallowed
    end = run_end_of(rec.path)
    assert end.status == "failed" and end.summary["error_type"] == "RuntimeError"
    assert end.summary["error"].startswith("the loss went to NaN") and len(end.summary["error"]) <= 500

    with pytest.raises(KeyboardInterrupt), recorder(tmp_path, "ctrl-c") as rec:
        raise KeyboardInterrupt
    assert run_end_of(rec.path).status == "interrupted"

    with recorder(tmp_path, "stop") as rec:
        action = apply_stop(rec, {"cause": "divergence"})
    end = run_end_of(rec.path)
    assert end.status == "stopped" and end.summary["stop_action_id"] == action.action_id

    with pytest.raises(SystemExit), recorder(tmp_path, "exit0") as rec:
        raise SystemExit(0)  # a clean sys.exit() in the loop is not a failure
    assert run_end_of(rec.path).status == "completed"


@pytest.mark.integration  # starts a process
def test_a_torch_loop_that_raises_inside_a_runwatch_with_block_ends_failed(tmp_path):
    """RunWatch itself (no broker: every event goes to its disk spool, read back here)."""
    spool_dir = tmp_path / "spool"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="bad batch"):
        with RunWatch("end-rw-failed", NO_BROKER, spool_dir=spool_dir, collect_metadata=False) as rw:
            watch = rw.watch(model, optimizer, memory=False, heartbeat_s=None)
            for step in range(3):
                x = torch.randn(8, 4) if step < 2 else None
                if x is None:
                    raise ValueError("bad batch at step 2")
                loss = model(x).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                watch.end_step(loss)
    assert rw.stats.spooled_at_close == 5  # run_start, two steps, the crash's facts, run_end
    with DiskSpool(spool_dir) as spool:
        events = [decode_event(r) for r in spool.peek(100)[1]]
    assert [e.kind for e in events] == ["run_start", "step", "step", "crash", "run_end"]
    crash = events[3]  # (issue 39: the loop's last words, for the worker to classify)
    assert crash.exception_type == "ValueError" and crash.message == "bad batch at step 2"
    assert crash.step == 1
    assert events[-1].status == "failed"
    assert events[-1].summary == {"error_type": "ValueError", "error": "bad batch at step 2"}


def test_runwatch_close_after_a_stop_and_atexit_style_close(tmp_path):
    spool_dir = tmp_path / "spool"
    rw = RunWatch("end-rw-stopped", NO_BROKER, spool_dir=spool_dir, collect_metadata=False)
    action = apply_stop(rw, {"cause": "not_recovered"})
    rw.close(1.0)  # what atexit calls: no status given
    with DiskSpool(spool_dir) as spool:
        events = [decode_event(r) for r in spool.peek(100)[1]]
    end = events[-1]
    assert end.kind == "run_end" and end.status == "stopped"
    assert end.summary == {"stop_action_id": action.action_id, "stop_cause": "not_recovered"}
