"""The sink checks every action as the trainer does (issue 35): one signed by the workers' key is kept, one
that is not is refused; and a batch whose every action fails verification says so, loudly and in one line:
the sink's public key is not the workers' (a wrong key was silent: every genuine action was dead-lettered
as if forged)."""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from types import SimpleNamespace

from runwatch.contract import topics
from runwatch.contract.schema import Action, utc_now
from runwatch.contract.signing import ActionPublicKeys, ActionSigningKey
from runwatch.sinks.consumer import SinkConsumer
from tests.support.action_keys import PUBLIC, WORKERS

LOGGER = "runwatch.sinks.consumer"


def _record(key: ActionSigningKey, offset: int) -> SimpleNamespace:
    now = utc_now()
    action = Action(
        action_id=uuid.uuid4().hex,
        run_id="run-s",
        kind="rollback",
        reason="r",
        issued_at=now,
        expires_at=now + timedelta(seconds=60),
    )
    value = key.sign(action).to_json()
    return SimpleNamespace(
        topic=topics.ACTIONS, partition=0, offset=offset, key=b"run-s", value=value, timestamp=None
    )


def _sink(public_keys: ActionPublicKeys) -> SinkConsumer:
    # (only the decoding is driven here: no store, no broker)
    return SinkConsumer(None, "unused:9092", summarize=False, public_keys=public_keys)  # type: ignore[arg-type]


def test_every_action_of_a_batch_failing_verification_is_said_in_one_line(caplog):
    wrong = ActionPublicKeys([ActionSigningKey.generate().public])  # not the workers'
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        batch, refused = _sink(wrong)._decode_batch([_record(WORKERS, n) for n in range(3)])
    assert [reason.split(":")[0] for _, reason in refused] == ["action bad_signature"] * 3
    said = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(said) == 1 and said[0].startswith(
        "runwatch sink: 3 of 3 actions fail verification: is the public key the workers'?"
    ), said
    assert "RUNWATCH_ACTION_PUBLIC_KEYS" in said[0] and wrong.key_ids[0] in said[0]


def test_a_forged_action_among_genuine_ones_is_refused_without_the_wrong_key_line(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        batch, refused = _sink(PUBLIC)._decode_batch(
            [_record(WORKERS, 0), _record(ActionSigningKey.generate(), 1), _record(WORKERS, 2)]
        )
    assert len(batch["actions"]) == 2 and [r.offset for r, _ in refused] == [1]
    assert not [r for r in caplog.records if "fail verification" in r.getMessage()]
