"""Trainers verify actions but cannot sign them (issue 35), on the real broker, the session's real worker
process, the real embedded ClickHouse and the remediator: a stop forged with everything a trainer holds (its
environment, with an old deployment's shared secret left in it, and the installed package) is refused by the
trainer's listener, the sink and the remediator, and gets no remediation, while the worker's own actions for
the same run pass all three; a rotation's two public keys accept actions signed by either key; a trainer
given the wrong public key says so once."""

from __future__ import annotations

import logging
import re
import sys
import threading
import uuid
from pathlib import Path

import pytest
import yaml

import runwatch
from runwatch.contract import topics
from runwatch.contract.schema import Action, decode_action, utc_now
from runwatch.contract.signing import ActionPublicKeys, ActionSigningKey
from runwatch.producer import ActionListener, MemoryDelivery, RunWatch
from runwatch.sinks import ClickHouseSink, SinkConsumer
from runwatch.sinks.remediate.config import load_remediation_config
from runwatch.sinks.remediate.consumer import RemediateConsumer
from runwatch.sinks.remediate.record import RemediationStore
from tests.conftest import eventually, publish_actions, read_topic_for
from tests.sinks.test_sink_poison import _sink_letters
from tests.support.action_keys import ActionKeys, forgeries, trainer_materials
from tests.worker.test_poison_cases import (
    assert_fault_found,
    new_run,
    producer,  # noqa: F401 - a fixture
    publish_fault_run,
    unharmed,  # noqa: F401 - a fixture
)

pytestmark = pytest.mark.integration

OLD_SECRET = "0123456789abcdef" * 4  # the shared RUNWATCH_ACTION_SECRET an old deployment gave every trainer
# Appends its arguments as one line to the marker file: proof of each remediation, no shell involved.
MARKER_SCRIPT = "import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + chr(10))"
PEM_BLOCK = re.compile(rb"-----BEGIN [A-Z ]*PRIVATE KEY-----\s*[A-Za-z0-9+/=]{16,}")


def _trainer(run_id: str, bootstrap: str, public_keys: str) -> tuple[RunWatch, ActionListener]:
    """A trainer's listener on the real broker (rank 1: it publishes no run_start of its own)."""
    rw = RunWatch(run_id, bootstrap, rank=1, world_size=2, collect_metadata=False, delivery=MemoryDelivery())
    listener = ActionListener(rw, public_keys=public_keys, consume=True, sync=False, state_path=False)
    assert listener.wait_ready(30)
    return rw, listener


def _remediation_config(path: Path, marker: Path) -> Path:
    command = [sys.executable, "-c", MARKER_SCRIPT, str(marker), "{action_id}", "{kind}", "{run_id}"]
    rule = {"kinds": ["alert", "rollback", "stop"], "commands": [{"argv": command, "timeout_s": 20}]}
    path.write_text(yaml.safe_dump({"rules": [rule]}))
    return path


def _started(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_the_installed_package_holds_no_private_key():
    """What `pip install runwatch` puts in a training environment: no file of it holds a private key."""
    found = []
    for root in runwatch.__path__:
        for path in Path(root).rglob("*"):
            if path.is_file() and PEM_BLOCK.search(path.read_bytes()):
                found.append(path)
    assert found == []


def test_a_stop_forged_with_everything_a_trainer_holds_is_refused_by_every_verifier(
    broker,
    unharmed,  # noqa: F811 - the fixture imported above: the session worker, signing with action_keys
    producer,  # noqa: F811
    action_keys,
    chdb_dsn,
    tmp_path,
):
    victim = new_run("victim")
    # What the tests' trainers are given (conftest.py: the public key), with an old deployment's shared
    # secret left in it; everything in it is material to sign with.
    trainer_env = {
        topics.BOOTSTRAP_ENV: broker.bootstrap,
        **action_keys.trainer_env,
        "RUNWATCH_ACTION_SECRET": OLD_SECRET,
    }
    assert topics.SIGNING_KEY_ENV not in trainer_env
    stop = Action(
        action_id=f"forged-stop-{uuid.uuid4().hex[:8]}",
        run_id=victim,
        kind="stop",
        reason="forged by a trainer",
        issued_at=utc_now(),
        expires_at=utc_now().replace(year=utc_now().year + 1),
    )
    forged = forgeries(stop, trainer_materials(*trainer_env.values()), action_keys.signing.key_id)
    assert len(forged) >= 10

    _rw, listener = _trainer(victim, broker.bootstrap, trainer_env[topics.PUBLIC_KEYS_ENV])
    store = ClickHouseSink(chdb_dsn)
    store.migrate()
    sink = SinkConsumer(
        store,
        broker.bootstrap,
        group_id=f"sink-{victim}",
        batch_interval_s=0.2,
        public_keys=action_keys.public,
    )
    marker = tmp_path / "remediated.txt"
    remediator = RemediateConsumer(
        load_remediation_config(str(_remediation_config(tmp_path / "remediate.yaml", marker))),
        action_keys.public,
        RemediationStore(store),
        broker.bootstrap,
        group_id=f"rem-{victim}",
    )
    threads = [_started(sink.run), _started(remediator.run)]
    try:
        eventually(
            lambda: sink.assigned.is_set() and remediator.assigned.is_set(), 60, "the consumers' partitions"
        )
        publish_fault_run(producer, victim)  # the worker's own alert and rollback for the same run
        assert_fault_found(broker.bootstrap, victim)
        publish_actions(broker.bootstrap, forged)

        # the trainer: the worker's two actions applied, no forged one
        applied: list = []
        eventually(
            lambda: applied.extend(listener.poll(step=100)) or len(applied) >= 2, 30, "the worker's actions"
        )
        assert [a.kind for a in applied[:2]] == ["alert", "rollback"]
        assert all(a.action.action_id != stop.action_id for a in applied)
        eventually(lambda: listener.ignored["bad_signature"] == len(forged), 30, "the forged stops refused")
        assert listener.poll(step=101) == []
        # (said once: a forger's stop looks like a wrong key to a trainer)
        assert listener.verification_warned
        # the remediator: it ran the worker's two, never the stop
        eventually(
            lambda: marker.exists() and marker.read_text().count(f" {victim}\n") >= 2, 60, "the remediations"
        )
        eventually(
            lambda: remediator.remediator.ignored["bad_signature"] >= len(forged), 30, "the forged stops"
        )
        # the sink: stores the worker's two, dead-letters every forged one as unverified
        eventually(lambda: store.runs.counts(victim)["actions"] == 2, 60, "the worker's actions stored")
        letters = eventually(
            lambda: len(_sink_letters(store, victim)) >= len(forged) and _sink_letters(store, victim),
            60,
            "the forged stops' dead letters",
        )
    finally:
        sink.stopping.set()
        remediator.stopping.set()
        for thread in threads:
            thread.join(60)
        listener.close()
    # What was remediated and stored is the worker's own, signed with its key: its alert and rollback (and,
    # when the test runs long, the alert and stop it may add for a rollback the stand-in trainer never
    # acknowledges), never the forged stop.
    issued = worker_actions(broker.bootstrap, victim, action_keys.public)
    # (the remediator's group is new: it also runs the unexpired actions of earlier tests' runs)
    lines = [line.split() for line in marker.read_text().splitlines()]
    remediated = {action_id: kind for action_id, kind, run_id in lines if run_id == victim}
    assert {"alert", "rollback"} <= set(remediated.values()) and stop.action_id not in remediated
    assert remediated.items() <= issued.items()
    assert RemediationStore(store).executions(stop.action_id) == []
    assert {reason.split(":")[0] for reason, *_ in letters.values()} == {"action bad_signature"}
    stored = store.query("SELECT action_id, kind FROM {db}.actions FINAL WHERE run_id = %(r)s", {"r": victim})
    assert {"alert", "rollback"} <= {k for _, k in stored} and dict(stored).items() <= issued.items()
    store.close()


def worker_actions(bootstrap: str, run_id: str, public: ActionPublicKeys) -> dict[str, str]:
    """action id -> kind of every action on the action topic for ``run_id`` that the worker's key signed."""
    key = run_id.encode()
    records = read_topic_for(bootstrap, topics.ACTIONS, 3.0)
    actions = [decode_action(r.value) for r in records if r.key == key]
    return {a.action_id: a.kind for a in actions if public.verify(a)}


def test_a_rotation_s_two_public_keys_accept_actions_signed_by_either(broker):
    old, new = ActionKeys.generate(), ActionKeys.generate()
    rotation = ActionPublicKeys(
        [new.signing.public, old.signing.public]
    ).text  # `runwatch keys rotate`'s line
    run_id = new_run("rotation")
    _rw, during = _trainer(run_id, broker.bootstrap, rotation)
    _rw2, after = _trainer(run_id, broker.bootstrap, new.public_text)  # the old key dropped
    now = utc_now()

    def alert(key: ActionSigningKey) -> Action:
        a = Action(
            action_id=uuid.uuid4().hex,
            run_id=run_id,
            kind="alert",
            reason=f"signed by {key.key_id}",
            issued_at=now,
            expires_at=now.replace(year=now.year + 1),
        )
        return key.sign(a)

    by_old, by_new = alert(old.signing), alert(new.signing)
    try:
        publish_actions(broker.bootstrap, [by_old, by_new])
        got: list = []
        eventually(lambda: got.extend(during.poll(step=1)) or len(got) >= 2, 30, "both actions")
        assert sorted(a.action.action_id for a in got) == sorted([by_old.action_id, by_new.action_id])
        late: list = []
        eventually(lambda: late.extend(after.poll(step=1)) or late, 30, "the new key's action")
        eventually(lambda: after.ignored["bad_signature"] == 1, 10, "the old key's action refused")
        assert [a.action.action_id for a in late] == [by_new.action_id]
    finally:
        during.close()
        after.close()


def test_a_trainer_with_the_wrong_public_key_says_so_once(broker, action_keys, caplog):
    run_id = new_run("wrongkey")
    wrong = ActionKeys.generate()  # not the workers'
    _rw, listener = _trainer(run_id, broker.bootstrap, wrong.public_text)
    now = utc_now()
    actions = [
        action_keys.signing.sign(
            Action(
                action_id=uuid.uuid4().hex,
                run_id=run_id,
                kind="rollback",
                reason="r",
                issued_at=now,
                expires_at=now.replace(year=now.year + 1),
            )
        )
        for _ in range(3)
    ]
    try:
        with caplog.at_level(logging.WARNING, logger="runwatch.producer.actions.listener"):
            publish_actions(broker.bootstrap, actions)
            eventually(lambda: listener.ignored["bad_signature"] == 3, 30, "the three refused")
        said = [r.getMessage() for r in caplog.records if "fail verification" in r.getMessage()]
        assert len(said) == 1, said
        assert said[0].startswith(
            f"runwatch: actions for run {run_id} fail verification: "
            "is RUNWATCH_ACTION_PUBLIC_KEYS the workers'"
        )
        assert action_keys.signing.key_id in said[0] and wrong.signing.key_id in said[0]
        assert listener.poll(step=1) == []
    finally:
        listener.close()
