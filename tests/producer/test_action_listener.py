"""The trainer acts only on signed, unexpired actions for its own run, and a rollback
restores the model and optimizer from the checkpoint registered before the anomaly."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
import torch
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import Action, CheckpointRef, decode_event, utc_now
from runwatch.contract.signing import ActionSigningKey, sign_action
from runwatch.producer import ActionListener, RunWatch, save_checkpoint
from runwatch.producer.publish.lr_hold import held_scale
from tests.conftest import eventually, read_topic
from tests.support.action_keys import ActionKeys

pytestmark = pytest.mark.integration


def make_action(
    run_id: str,
    kind: str,
    key: ActionSigningKey,
    *,
    onset: int,
    ttl_s: float = 60,
    issued_delta_s: float = 0,
    target: CheckpointRef | None = None,
    params: dict | None = None,
) -> Action:
    issued = utc_now() + timedelta(seconds=issued_delta_s)
    action = Action(
        action_id=uuid.uuid4().hex,
        run_id=run_id,
        kind=kind,
        reason="test",
        step=onset + 2,
        onset_step=onset,
        target_checkpoint=target,
        params=params or {},
        issued_at=issued,
        expires_at=issued + timedelta(seconds=ttl_s),
    )
    return sign_action(action, key)


def test_forged_and_expired_actions_are_ignored_and_a_valid_rollback_restores(broker, tmp_path):
    keys = ActionKeys.generate()  # this test's workers' key; the trainer holds its public half
    run_id = f"al-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rw = RunWatch(run_id, broker.bootstrap)
    listener = ActionListener(rw, model, optimizer, public_keys=keys.public_text)
    assert listener.wait_ready(30)

    # Two checkpoints: step 10 (before the fault at 15) and step 20 (after it).
    def train_once():
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    train_once()
    save_checkpoint(str(tmp_path / "c10.pt"), model, optimizer)
    rw.checkpoint(10, str(tmp_path / "c10.pt"))
    good_weights = model.weight.detach().clone()
    for _ in range(3):
        train_once()
    save_checkpoint(str(tmp_path / "c20.pt"), model, optimizer)
    rw.checkpoint(20, str(tmp_path / "c20.pt"))
    assert not torch.equal(model.weight, good_weights)

    forged = make_action(run_id, "rollback", ActionSigningKey.generate(), onset=15)
    expired = make_action(run_id, "rollback", keys.signing, onset=15, ttl_s=5, issued_delta_s=-10)
    tampered = make_action(run_id, "rollback", keys.signing, onset=15).model_copy(update={"onset_step": 25})
    other_run = make_action("someone-else", "rollback", keys.signing, onset=15)
    valid = make_action(run_id, "rollback", keys.signing, onset=15)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
    for action in (forged, expired, tampered, other_run, valid, valid):  # the valid one delivered twice
        producer.send(topics.ACTIONS, key=action.run_id.encode(), value=action.to_json())
    producer.flush()
    producer.close()

    applied = []
    eventually(lambda: applied.extend(listener.poll(step=22)) or applied, 30, "the valid rollback")
    eventually(
        lambda: listener.ignored["duplicate"] >= 1 and listener.ignored["other_run"] >= 1,
        10,
        "every bad action to be judged",
    )
    assert [a.action.action_id for a in applied] == [valid.action_id]
    result = applied[0]
    assert (result.outcome, result.to_step, result.from_step) == ("applied", 10, 22)
    assert torch.equal(model.weight, good_weights)  # restored from the step-10 checkpoint
    # (other tests' recent actions on the shared topic count as other_run too)
    ignored = dict(listener.ignored)
    assert ignored.pop("other_run") >= 1
    assert ignored == {"bad_signature": 2, "expired": 1, "duplicate": 1}
    assert listener.poll(step=23) == []

    listener.close()
    rw.close()
    key = run_id.encode()
    acks = read_topic(
        broker.bootstrap,
        topics.TELEMETRY,
        lambda rs: any(b'"action_ack"' in r.value for r in rs if r.key == key),
    )
    ack = next(decode_event(r.value) for r in acks if r.key == key and b'"action_ack"' in r.value)
    assert (ack.action_id, ack.outcome, ack.to_step) == (valid.action_id, "applied", 10)


def test_rollback_without_an_earlier_checkpoint_fails_visibly(broker, tmp_path):
    keys = ActionKeys.generate()  # this test's workers' key; the trainer holds its public half
    run_id = f"al-{uuid.uuid4().hex[:8]}"
    model = torch.nn.Linear(2, 1)
    rw = RunWatch(run_id, broker.bootstrap)
    listener = ActionListener(rw, model, public_keys=keys.public_text)
    assert listener.wait_ready(30)
    save_checkpoint(str(tmp_path / "late.pt"), model)
    rw.checkpoint(50, str(tmp_path / "late.pt"))
    action = make_action(run_id, "rollback", keys.signing, onset=40)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
    producer.send(topics.ACTIONS, key=run_id.encode(), value=action.to_json())
    producer.flush()
    producer.close()
    applied = []
    eventually(lambda: applied.extend(listener.poll(step=45)) or applied, 30, "the rollback")
    assert applied[0].outcome == "failed" and applied[0].to_step is None
    assert "no registered checkpoint" in applied[0].detail
    listener.close()
    rw.close()


def _send(bootstrap: str, *actions: Action) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    for action in actions:
        producer.send(topics.ACTIONS, key=action.run_id.encode(), value=action.to_json())
    producer.flush()
    producer.close()


def test_rollback_scales_the_lr_and_pause_holds_until_resume(broker, tmp_path):
    keys = ActionKeys.generate()  # this test's workers' key; the trainer holds its public half
    run_id = f"al-{uuid.uuid4().hex[:8]}"
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rw = RunWatch(run_id, broker.bootstrap, rank=2, world_size=4)
    listener = ActionListener(rw, model, optimizer, public_keys=keys.public_text)
    assert listener.wait_ready(30)
    save_checkpoint(str(tmp_path / "c5.pt"), model, optimizer)
    rw.checkpoint(5, str(tmp_path / "c5.pt"))

    rollback = make_action(
        run_id, "rollback", keys.signing, onset=8, params={"lr_scale": 0.5, "skip_steps": [6, 10]}
    )
    _send(broker.bootstrap, rollback)
    applied = []
    eventually(lambda: applied.extend(listener.poll(step=11)) or applied, 30, "the rollback")
    assert (applied[0].outcome, applied[0].to_step, applied[0].skip_steps) == ("applied", 5, (6, 10))
    # the run's own LR, with the rollback's scale held in every update (publish/lr_hold.py)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3) and held_scale(optimizer) == 0.5

    pause, resume = (
        make_action(run_id, "pause", keys.signing, onset=12),
        make_action(run_id, "resume", keys.signing, onset=12),
    )
    _send(broker.bootstrap, pause)
    sender = threading.Timer(1.0, _send, (broker.bootstrap, resume))
    sender.start()
    paused = []
    eventually(lambda: paused.extend(listener.poll(step=12)) or paused, 30, "the pause and the resume")
    sender.join()
    assert [r.kind for r in paused] == ["pause", "resume"]
    assert f"until resume {resume.action_id}" in paused[0].detail
    assert paused[1].detail == f"ended pause {pause.action_id}"
    listener.close()
    rw.close()

    key = run_id.encode()
    records = read_topic(
        broker.bootstrap,
        topics.TELEMETRY,
        lambda rs: sum(b'"action_ack"' in r.value for r in rs if r.key == key) >= 3,
    )
    acks = [decode_event(r.value) for r in records if r.key == key and b'"action_ack"' in r.value]
    assert [(a.action_id, a.rank) for a in acks] == [
        (rollback.action_id, 2),
        (pause.action_id, 2),
        (resume.action_id, 2),
    ]
