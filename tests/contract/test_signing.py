"""Action signatures: a trainer acts only on actions signed by the workers' Ed25519 key, and what it
holds (the public keys) cannot sign; any change to a signed action breaks its signature, a signed action
still verifies after travelling as JSON, a garbage signature is rejected (not a crash of the verifier),
two public keys (a rotation) accept actions signed by either, and nothing runs without a key."""

from __future__ import annotations

import math
import stat
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import Action, CheckpointRef, decode_action
from runwatch.contract.signing import (
    ActionPublicKey,
    ActionPublicKeys,
    ActionSigningKey,
    MissingKeyError,
    resolve_public_keys,
    resolve_signing_key,
    sign_action,
    verify_action,
)
from runwatch.contract.topics import LEGACY_SECRET_ENV, PUBLIC_KEYS_ENV, SIGNING_KEY_ENV

WORKERS = ActionSigningKey.from_seed(bytes(range(32)))  # the workers' key
PUBLIC = ActionPublicKeys([WORKERS.public])  # what trainers, the sink and the remediator hold
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
    signed = sign_action(_action(), WORKERS)
    scheme, kid, signature = signed.signature.split(":")
    assert (scheme, kid, len(signature)) == ("ed25519", WORKERS.key_id, 88)  # base64 of 64 bytes
    assert verify_action(signed, PUBLIC)
    assert verify_action(signed, WORKERS.public)


def test_unsigned_action_does_not_verify():
    assert not verify_action(_action(), PUBLIC)


def test_signing_is_deterministic():
    assert sign_action(_action(), WORKERS).signature == sign_action(_action(), WORKERS).signature  # (Ed25519)


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
    signed = sign_action(_action(), WORKERS)
    tampered = signed.model_copy(update=change)
    assert not verify_action(tampered, PUBLIC)


def test_changing_the_signature_breaks_verification():
    signed = sign_action(_action(), WORKERS)
    flipped = signed.signature[:-4] + ("AAA=" if not signed.signature.endswith("AAA=") else "AQA=")
    prefix, kid, body = signed.signature.split(":")
    for bad in (
        flipped,
        "",
        signed.signature.upper(),
        f"{prefix}:{'0' * 16}:{body}",  # another key's id
        f"hmac:{kid}:{body}",
        f"{prefix}:{kid}:{body}:extra",
        f"{prefix}:{kid}:{body[:-8]}",  # too short
        f"{prefix}:{kid}:not base64!",
    ):
        assert not verify_action(signed.model_copy(update={"signature": bad}), PUBLIC), bad


def test_another_key_fails():
    signed = sign_action(_action(), ActionSigningKey.generate())
    assert not verify_action(signed, PUBLIC)


def test_nothing_a_verifier_holds_makes_a_signature_that_verifies():
    """Whatever a verifier holds, it cannot sign: an action 'signed' with the public key's bytes taken for
    a private seed, or with the old HMAC over the same body, is refused."""
    import hashlib
    import hmac

    as_seed = sign_action(_action(), ActionSigningKey.from_seed(WORKERS.public.raw))
    assert not verify_action(as_seed, PUBLIC)
    body = _action().body_bytes()
    for key in (WORKERS.public.raw, PUBLIC.text.encode()):
        forged = _action().model_copy(update={"signature": hmac.new(key, body, hashlib.sha256).hexdigest()})
        assert not verify_action(forged, PUBLIC)


def test_signed_action_still_verifies_after_the_wire():
    signed = sign_action(_action(), WORKERS)
    received = decode_action(signed.to_json())
    assert verify_action(received, PUBLIC)


def test_tampering_on_the_wire_is_detected():
    raw = sign_action(_action(), WORKERS).to_json().replace(b"/ckpt/5.pt", b"/ckpt/6.pt")
    assert not verify_action(decode_action(raw), PUBLIC)


def test_non_ascii_signature_is_rejected_not_raised():
    # Anything can be written to the actions topic; a garbage signature must be a plain "no".
    signed = sign_action(_action(), WORKERS)
    garbled = signed.model_copy(update={"signature": "é" * 64})
    assert verify_action(garbled, PUBLIC) is False
    garbled = signed.model_copy(update={"signature": f"ed25519:{WORKERS.key_id}:" + "é" * 88})
    assert verify_action(garbled, PUBLIC) is False


def test_action_with_non_finite_param_still_verifies_after_the_wire():
    # params is free-form; a non-finite float in it must not make a genuine action unverifiable.
    signed = sign_action(_action(params={"timeout_s": math.inf}), WORKERS)
    received = decode_action(signed.to_json())
    assert verify_action(received, PUBLIC)


def test_rotation_two_public_keys_accept_either_and_nothing_else():
    old, new = WORKERS, ActionSigningKey.generate()
    rotation = resolve_public_keys(f"{new.public.text}, {old.public.text}")
    assert rotation.key_ids == [new.key_id, old.key_id]
    assert verify_action(sign_action(_action(), old), rotation)
    assert verify_action(sign_action(_action(), new), rotation)
    assert not verify_action(sign_action(_action(), ActionSigningKey.generate()), rotation)
    # a signature naming the old key but made by the new one is refused: the key id picks, not tries
    by_new = sign_action(_action(), new).signature.split(":")
    assert not verify_action(
        _action().model_copy(update={"signature": f"ed25519:{old.key_id}:{by_new[2]}"}), rotation
    )
    # after the rotation (the old key dropped), the old key's actions are refused
    assert not verify_action(sign_action(_action(), old), resolve_public_keys(new.public.text))


def test_public_keys_text_round_trips_and_deduplicates():
    text = PUBLIC.text
    assert text.startswith("ed25519:") and len(text) == len("ed25519:") + 44
    assert ActionPublicKeys.parse(f"{text},{text}").text == text
    assert ActionPublicKey.parse(text) == WORKERS.public


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "no action public key"),
        ("   ", "no action public key"),
        ("ed25519:xx", "not base64"),
        ("ed25519:" + "A" * 40 + "==", "32 bytes"),
        ("AAAA", "ed25519:<base64>"),
        (WORKERS.pem().decode(), "private key"),
    ],
    ids=["unset", "blank", "not-base64", "short", "no-prefix", "a-private-key"],
)
def test_public_keys_that_are_not_are_refused_saying_what_to_do(monkeypatch, value, says):
    monkeypatch.setenv(PUBLIC_KEYS_ENV, value)
    with pytest.raises(MissingKeyError, match=says):
        resolve_public_keys()


def test_a_missing_public_key_names_the_old_secret_when_it_is_set(monkeypatch):
    monkeypatch.delenv(PUBLIC_KEYS_ENV, raising=False)
    monkeypatch.setenv(LEGACY_SECRET_ENV, "x" * 64)
    with pytest.raises(MissingKeyError, match=f"{LEGACY_SECRET_ENV} is set but no longer used"):
        resolve_public_keys()


def test_the_signing_key_from_pem_text_or_a_file(monkeypatch, tmp_path):
    pem = WORKERS.pem().decode()
    assert pem.startswith("-----BEGIN PRIVATE KEY-----")
    monkeypatch.setenv(SIGNING_KEY_ENV, pem)
    assert resolve_signing_key().key_id == WORKERS.key_id
    path = tmp_path / "k.pem"
    path.write_text(pem)
    monkeypatch.setenv(SIGNING_KEY_ENV, str(path))
    assert resolve_signing_key().seed == WORKERS.seed
    assert resolve_signing_key(pem).seed == WORKERS.seed  # explicit wins


def test_the_signing_key_on_one_line_as_an_env_file_or_from_literal_holds_it():
    pem = WORKERS.pem().decode()
    for one_line in (pem.replace("\n", " "), pem.replace("\n", "\\n"), pem.strip().replace("\n", "  ")):
        assert "\n" not in one_line.strip()
        assert resolve_signing_key(one_line).seed == WORKERS.seed


def test_openssl_pem_keys_are_read(tmp_path):
    """``openssl genpkey -algorithm ed25519`` writes the same PKCS#8 form (made here with the library)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    assert resolve_signing_key(pem.decode()).public.raw


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "no action signing key"),
        ("/nonexistent/key.pem", "cannot read the key file"),
        ("ed25519:" + "A" * 43 + "=", "holds a public key"),
        ("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "not an unencrypted PEM"),
    ],
    ids=["unset", "no-file", "a-public-key", "garbage-pem"],
)
def test_signing_keys_that_are_not_are_refused_saying_what_to_do(monkeypatch, value, says):
    monkeypatch.setenv(SIGNING_KEY_ENV, value)
    with pytest.raises(MissingKeyError, match=says):
        resolve_signing_key()


def test_an_ecdsa_key_is_not_a_signing_key():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with pytest.raises(MissingKeyError, match="not an Ed25519 private key"):
        resolve_signing_key(pem.decode())


def test_env_names():
    assert (SIGNING_KEY_ENV, PUBLIC_KEYS_ENV) == (
        "RUNWATCH_ACTION_SIGNING_KEY",
        "RUNWATCH_ACTION_PUBLIC_KEYS",
    )


def test_signature_follows_the_documented_canonical_form():
    """A verifier in another language follows the README: Ed25519 over the received JSON without
    ``signature``, keys sorted, compact, with the public key whose id the signature names. No Python model
    is needed to check it."""
    import base64
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

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
        WORKERS,
    )
    received = json.loads(action.to_json())
    scheme, kid, signature = received.pop("signature").split(":")
    canonical = json.dumps(received, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    public_text = PUBLIC.text  # what RUNWATCH_ACTION_PUBLIC_KEYS holds
    raw = base64.b64decode(public_text.removeprefix("ed25519:"))
    import hashlib

    assert scheme == "ed25519" and kid == hashlib.sha256(raw).hexdigest()[:16]
    Ed25519PublicKey.from_public_bytes(raw).verify(base64.b64decode(signature), canonical)  # raises if not


def test_key_files_are_written_for_their_owner_only(tmp_path):
    from runwatch.local.secret import write_private_file

    path = tmp_path / "k.pem"
    write_private_file(path, WORKERS.pem().decode())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        write_private_file(path, "x")
