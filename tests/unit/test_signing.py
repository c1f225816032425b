"""Action signatures: the trainer must act only on actions signed with the shared secret, any change
to a signed action must break its signature, a signed action must still verify after travelling as
JSON, a garbage signature must be rejected (not crash the verifier), and nothing may run unsigned."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.producer.wire.schema import Action, CheckpointRef, decode_action
from runwatch.producer.wire.signing import MissingSecretError, resolve_secret, sign_action, verify_action
from runwatch.producer.wire.topics import SECRET_ENV

SECRET = b"s3cret-shared-by-worker-and-trainer"
ISSUED = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


def _action(**overrides) -> Action:
    fields = dict(
        action_id="a1b2",
        run_id="run-1",
        kind="rollback",
        reason="non-finite loss for 3 step(s) since step 10",
        anomaly_ids=["an-1"],
        step=12,
        onset_step=10,
        target_checkpoint=CheckpointRef(step=5, uri="/ckpt/5.pt"),
        params={"note": "x"},
        issued_at=ISSUED,
        expires_at=ISSUED + timedelta(seconds=120),
    )
    fields.update(overrides)
    return Action(**fields)


def test_signed_action_verifies():
    signed = sign_action(_action(), SECRET)
    assert len(signed.signature) == 64
    assert verify_action(signed, SECRET)


def test_unsigned_action_does_not_verify():
    assert not verify_action(_action(), SECRET)


def test_signing_is_deterministic():
    assert sign_action(_action(), SECRET).signature == sign_action(_action(), SECRET).signature


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "stop"},
        {"run_id": "run-2"},
        {"action_id": "other"},
        {"expires_at": ISSUED + timedelta(days=365)},
        {"issued_at": ISSUED + timedelta(seconds=1)},
        {"target_checkpoint": CheckpointRef(step=0, uri="/ckpt/5.pt")},
        {"target_checkpoint": CheckpointRef(step=5, uri="/evil.pt")},
        {"target_checkpoint": None},
        {"onset_step": 11},
        {"params": {"note": "y"}},
        {"anomaly_ids": []},
    ],
    ids=lambda c: next(iter(c)),
)
def test_changing_any_field_breaks_the_signature(change):
    signed = sign_action(_action(), SECRET)
    tampered = signed.model_copy(update=change)
    assert not verify_action(tampered, SECRET)


def test_changing_the_signature_breaks_verification():
    signed = sign_action(_action(), SECRET)
    flipped = ("0" if signed.signature[0] != "0" else "1") + signed.signature[1:]
    assert not verify_action(signed.model_copy(update={"signature": flipped}), SECRET)
    assert not verify_action(signed.model_copy(update={"signature": ""}), SECRET)
    assert not verify_action(signed.model_copy(update={"signature": signed.signature.upper()}), SECRET)


def test_wrong_secret_fails():
    signed = sign_action(_action(), SECRET)
    assert not verify_action(signed, b"another-secret")


def test_signed_action_still_verifies_after_the_wire():
    signed = sign_action(_action(), SECRET)
    received = decode_action(signed.to_json())
    assert verify_action(received, SECRET)


def test_tampering_on_the_wire_is_detected():
    raw = sign_action(_action(), SECRET).to_json().replace(b"/ckpt/5.pt", b"/ckpt/6.pt")
    assert not verify_action(decode_action(raw), SECRET)


def test_non_ascii_signature_is_rejected_not_raised():
    # Anything can be written to the actions topic; a garbage signature must be a plain "no".
    signed = sign_action(_action(), SECRET)
    garbled = signed.model_copy(update={"signature": "é" * 64})
    assert verify_action(garbled, SECRET) is False


def test_action_with_non_finite_param_still_verifies_after_the_wire():
    # params is free-form; a non-finite float in it must not make a genuine action unverifiable.
    signed = sign_action(_action(params={"timeout_s": math.inf}), SECRET)
    received = decode_action(signed.to_json())
    assert verify_action(received, SECRET)


def test_resolve_secret_refuses_to_run_unsigned(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(MissingSecretError, match=SECRET_ENV):
        resolve_secret()
    with pytest.raises(MissingSecretError):
        resolve_secret("")


FROM_ENV = "from-env-" + "e" * 24
EXPLICIT = "explicit-" + "x" * 23


def test_resolve_secret_reads_the_environment(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, FROM_ENV)
    assert resolve_secret() == FROM_ENV.encode()


def test_explicit_secret_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, FROM_ENV)
    assert resolve_secret(EXPLICIT) == EXPLICIT.encode()
    assert resolve_secret(EXPLICIT.encode()) == EXPLICIT.encode()


@pytest.mark.parametrize("short", ["x", "a" * 31, b"\x00" * 31])
def test_a_secret_shorter_than_32_bytes_is_refused_with_how_to_make_one(short):
    with pytest.raises(MissingSecretError, match=r"at least 32 are needed.*token_hex"):
        resolve_secret(short)


def test_a_32_byte_secret_is_accepted():
    assert resolve_secret("s" * 32) == b"s" * 32


def test_secret_env_name():
    assert SECRET_ENV == "RUNWATCH_ACTION_SECRET"


def test_signature_follows_the_documented_canonical_form():
    """A verifier in another language follows the README: HMAC-SHA256 of the received JSON
    without ``signature``, keys sorted, compact. No Python model is needed to check it."""
    import hashlib
    import hmac
    import json
    from datetime import UTC, datetime, timedelta

    from runwatch.producer.wire.schema import Action, CheckpointRef
    from runwatch.producer.wire.signing import sign_action

    issued = datetime(2026, 11, 21, 9, 30, tzinfo=UTC)
    action = sign_action(
        Action(
            action_id="a1",
            run_id="run-42",
            kind="rollback",
            reason="loss 3×10⁴ — NaN next",
            anomaly_ids=["x"],
            step=7,
            onset_step=5,
            target_checkpoint=CheckpointRef(step=4, uri="/c/4.pt"),
            params={"lr_scale": 0.5},
            issued_at=issued,
            expires_at=issued + timedelta(seconds=60),
        ),
        b"k",
    )
    received = json.loads(action.to_json())
    signature = received.pop("signature")
    canonical = json.dumps(received, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert hmac.new(b"k", canonical, hashlib.sha256).hexdigest() == signature
