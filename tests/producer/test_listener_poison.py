"""Issue 11, item 9, with the real broker, a real ActionListener and a real torch model: a validly
signed stop dated 2 h ahead is ignored and counted ``future``; a stop applied before a trainer
restart is not applied again by the restarted trainer (same run and rank, same state file), although
the start-time allowance would take it; an action for another run is counted ``other_run``.

Each test waits for a marker action published after the one under test on the same partition (the
run's key): once the marker is applied, the action before it has been judged."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import Action, decode_event, utc_now
from runwatch.contract.signing import ActionSigningKey, sign_action
from runwatch.producer import ActionListener, RunWatch
from runwatch.producer.actions.applied_ids import default_state_path
from tests.conftest import eventually, read_topic

pytestmark = pytest.mark.integration


def make_action(
    run_id: str, kind: str, key: ActionSigningKey, *, issued_delta_s: float = 0, ttl_s: float = 60
) -> Action:
    issued = utc_now() + timedelta(seconds=issued_delta_s)
    action = Action(
        action_id=uuid.uuid4().hex,
        run_id=run_id,
        kind=kind,
        reason="poison test",
        step=12,
        onset_step=10,
        issued_at=issued,
        expires_at=issued + timedelta(seconds=ttl_s),
    )
    return sign_action(action, key)


def send(bootstrap: str, *actions: Action, key: str | None = None) -> None:
    """Publish ``actions`` in order, keyed by ``key`` (default: each action's run id)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    try:
        for action in actions:
            producer.send(topics.ACTIONS, key=(key or action.run_id).encode(), value=action.to_json())
        producer.flush(timeout=30)
    finally:
        producer.close(timeout=10)


def poll_until(listener: ActionListener, action_id: str, timeout: float = 30.0) -> list:
    """Poll like a training loop until ``action_id`` was applied; returns everything applied meanwhile."""
    applied: list = []

    def done() -> bool:
        applied.extend(listener.poll(step=20))
        return any(a.action.action_id == action_id for a in applied)

    eventually(done, timeout, f"action {action_id} to be applied")
    return applied


def acks_of(bootstrap: str, run_id: str, until_id: str) -> list:
    """The run's acknowledgements on the telemetry topic, read until the one for ``until_id`` is there."""
    key = run_id.encode()
    records = read_topic(
        bootstrap, topics.TELEMETRY, lambda rs: any(r.key == key and until_id.encode() in r.value for r in rs)
    )
    return [decode_event(r.value) for r in records if r.key == key and b'"action_ack"' in r.value]


@pytest.fixture
def trainer(broker, action_keys) -> Iterator:
    """A small real model and optimizer, and a factory for RunWatch + ActionListener pairs that are
    closed at the end whatever happens."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    opened: list = []

    def start(run_id: str, rank: int = 0, **options) -> tuple[RunWatch, ActionListener]:
        rw = RunWatch(run_id, broker.bootstrap, rank=rank, world_size=2)
        opened.append(rw)
        listener = ActionListener(rw, model, optimizer, public_keys=action_keys.public_text, **options)
        opened.append(listener)
        assert listener.wait_ready(30)
        return rw, listener

    yield model, optimizer, start
    for thing in reversed(opened):
        with contextlib.suppress(Exception):
            thing.close()


def test_a_signed_stop_dated_two_hours_ahead_is_ignored_and_counted_as_future(broker, action_keys, trainer):
    model, optimizer, start = trainer
    run_id = f"poison-future-{uuid.uuid4().hex[:8]}"
    rw, listener = start(run_id, state_path=False)
    weights = model.weight.detach().clone()
    future = make_action(run_id, "stop", action_keys.signing, issued_delta_s=2 * 3600)
    marker = make_action(run_id, "alert", action_keys.signing)
    send(broker.bootstrap, future, marker)

    applied = poll_until(listener, marker.action_id)
    assert [a.action.action_id for a in applied] == [marker.action_id]  # the stop never reached the loop
    assert listener.ignored["future"] == 1
    assert listener.watchdog.thread is None  # not armed on receipt either
    assert torch.equal(model.weight, weights)
    assert listener.poll(step=21) == []
    listener.close()
    rw.close()
    acks = acks_of(broker.bootstrap, run_id, marker.action_id)
    assert [a.action_id for a in acks] == [marker.action_id]  # nothing acknowledged the future stop


def test_a_trainer_restarted_seconds_after_a_stop_does_not_apply_it_again(broker, action_keys, trainer):
    _model, _optimizer, start = trainer
    run_id = f"poison-restart-{uuid.uuid4().hex[:8]}"
    first_rw, first = start(run_id)  # default state file: beside the rank's spool directory
    state = default_state_path(first_rw)
    assert state.name == f"{run_id}-r0.actions"
    stop = make_action(run_id, "stop", action_keys.signing)
    send(broker.bootstrap, stop)
    assert [a.kind for a in poll_until(first, stop.action_id)] == ["stop"]
    assert json.loads(state.read_text())["applied"] == [stop.action_id]
    first.close()  # the trainer exits gracefully on the stop
    first_rw.close()

    try:
        # It is started again at once (as if 5 s later): the stop, issued seconds ago, is within the
        # 30 s start-time allowance and the consumer reads it again from the topic.
        restarted_rw, restarted = start(run_id)
        assert default_state_path(restarted_rw) == state
        # The control, on the other rank's identity and without a state file, shows the redelivery.
        _control_rw, control = start(run_id, rank=1, state_path=False)
        marker = make_action(run_id, "alert", action_keys.signing)
        send(broker.bootstrap, marker)

        applied = poll_until(restarted, marker.action_id)
        assert [a.action.action_id for a in applied] == [marker.action_id]
        assert restarted.ignored["already_applied"] == 1
        assert [a.kind for a in poll_until(control, marker.action_id)] == ["stop", "alert"]
        assert json.loads(state.read_text())["applied"] == [stop.action_id, marker.action_id]
        restarted.close()
        restarted_rw.close()
        acks = [
            (a.action_id, a.rank) for a in acks_of(broker.bootstrap, run_id, marker.action_id) if a.rank == 0
        ]
        assert sorted(acks) == sorted([(stop.action_id, 0), (marker.action_id, 0)])  # the stop acked once
    finally:
        state.unlink(missing_ok=True)


def test_an_action_for_another_run_is_counted_as_other_run(broker, action_keys, trainer):
    _model, _optimizer, start = trainer
    run_id = f"poison-ours-{uuid.uuid4().hex[:8]}"
    _rw, listener = start(run_id, state_path=False)
    theirs = make_action(
        f"poison-theirs-{uuid.uuid4().hex[:8]}", "stop", action_keys.signing
    )  # validly signed, not ours
    marker = make_action(run_id, "alert", action_keys.signing)
    # Keyed by our run, so it shares our partition and is judged before the marker.
    send(broker.bootstrap, theirs, marker, key=run_id)

    applied = poll_until(listener, marker.action_id)
    assert [a.action.action_id for a in applied] == [marker.action_id]
    assert listener.ignored["other_run"] >= 1  # other tests' actions for their runs may be counted too
    assert listener.watchdog.thread is None
