"""Honest run ends through the real broker: a signed stop action put on the action topic reaches
the trainer's ActionListener, the loop stops, and the ``run_end`` the trainer publishes on the
telemetry topic says ``stopped`` with that action's id and cause. A loop that raises inside
``with RunWatch(...)`` publishes ``failed``."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
import torch

from runwatch.contract import topics
from runwatch.contract.schema import Action, decode_event, utc_now
from runwatch.contract.signing import sign_action
from runwatch.producer import ActionListener, RunWatch
from tests.conftest import publish_actions, read_topic
from tests.support.action_keys import PUBLIC, WORKERS

pytestmark = pytest.mark.integration


def run_end(bootstrap: str, run_id: str):
    def ends(records: list) -> list:
        return [
            e
            for e in (decode_event(r.value) for r in records if r.key == run_id.encode())
            if e.kind == "run_end"
        ]

    [end] = ends(read_topic(bootstrap, topics.TELEMETRY, lambda records: bool(ends(records))))
    return end


def test_a_stop_action_ends_the_run_as_stopped_with_its_id_and_cause(broker, tmp_path):
    run_id = f"end-stop-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    stop = None
    with RunWatch(run_id, broker.bootstrap, collect_metadata=False, spool_dir=tmp_path / "spool") as rw:
        watch = rw.watch(model, optimizer, memory=False)
        listener = ActionListener(rw, model, optimizer, public_keys=PUBLIC.text, state_path=False)
        assert listener.wait_ready(30)
        stopped_at = None
        for step in range(10_000):
            loss = model(torch.randn(16, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            watch.end_step(loss, step=step)
            if step == 5:
                issued = utc_now()
                stop = sign_action(
                    Action(
                        action_id=uuid.uuid4().hex,
                        run_id=run_id,
                        kind="stop",
                        reason="test",
                        step=5,
                        params={"cause": "not_recovered"},
                        issued_at=issued,
                        expires_at=issued + timedelta(seconds=60),
                    ),
                    WORKERS,
                )
                publish_actions(broker.bootstrap, [stop])
            if any(a.kind == "stop" for a in listener.poll(step)):
                stopped_at = step
                break
            if step > 5:
                time.sleep(0.01)  # the loop goes on (up to 100 s) until the stop arrives
        listener.close()
    assert stopped_at is not None and stop is not None
    assert rw.stats.published == rw.stats.queued
    end = run_end(broker.bootstrap, run_id)
    assert end.status == "stopped"
    assert end.summary == {"stop_action_id": stop.action_id, "stop_cause": "not_recovered"}


def test_a_loop_that_raises_inside_the_with_block_ends_failed(broker, tmp_path):
    run_id = f"end-fail-{uuid.uuid4().hex[:8]}"
    model = torch.nn.Linear(4, 1)
    with pytest.raises(FloatingPointError):
        with RunWatch(run_id, broker.bootstrap, collect_metadata=False, spool_dir=tmp_path / "spool") as rw:
            watch = rw.watch(model, None, lr=0.1, memory=False)
            for step in range(3):
                loss = model(torch.randn(4, 4)).pow(2).mean()
                watch.end_step(loss, step=step)
            raise FloatingPointError("loss is inf")
    end = run_end(broker.bootstrap, run_id)
    assert end.status == "failed"
    assert end.summary == {"error_type": "FloatingPointError", "error": "loss is inf"}
