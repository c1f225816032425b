"""`runwatch keys`: generation, rotation and distribution, one command each (issue 35). The private key is
written for its owner only and never over another file; what is printed on stdout is the value to hand on
(RUNWATCH_ACTION_PUBLIC_KEYS); a rotation's line holds the new key and the ones in use, and both verify."""

from __future__ import annotations

import stat
import uuid
from datetime import timedelta

from click.testing import CliRunner

from runwatch.cli.main import main
from runwatch.contract.schema import Action, utc_now
from runwatch.contract.signing import resolve_public_keys, resolve_signing_key


def _run(*args: str, env: dict[str, str] | None = None):
    clean = {"RUNWATCH_ACTION_SIGNING_KEY": None, "RUNWATCH_ACTION_PUBLIC_KEYS": None, **(env or {})}
    return CliRunner().invoke(main, ["keys", *args], env=clean)


def _action() -> Action:
    now = utc_now()
    return Action(
        action_id=uuid.uuid4().hex,
        run_id="r",
        kind="stop",
        reason="r",
        issued_at=now,
        expires_at=now + timedelta(1),
    )


def test_generate_writes_the_private_key_for_its_owner_and_prints_the_public_key(tmp_path):
    out = tmp_path / "k.pem"
    done = _run("generate", "--out", str(out))
    assert done.exit_code == 0, done.output
    public = done.stdout.strip()
    assert public.startswith("ed25519:") and "\n" not in public
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert "give it to the workers only" in done.stderr
    key = resolve_signing_key(str(out))
    assert resolve_public_keys(public).verify(key.sign(_action()))
    again = _run("generate", "--out", str(out))  # never over a key file
    assert again.exit_code == 2 and "exists" in again.stderr
    assert resolve_signing_key(str(out)).key_id == key.key_id


def test_public_prints_the_keys_to_hand_on(tmp_path):
    a, b = tmp_path / "a.pem", tmp_path / "b.pem"
    pub_a = _run("generate", "--out", str(a)).stdout.strip()
    pub_b = _run("generate", "--out", str(b)).stdout.strip()
    assert _run("public", str(a)).stdout.strip() == pub_a
    assert _run("public", str(b), pub_a).stdout.strip() == f"{pub_b},{pub_a}"
    assert _run("public", f"{pub_a},{pub_b}", str(a)).stdout.strip() == f"{pub_a},{pub_b}"  # no repeats
    from_env = _run("public", env={"RUNWATCH_ACTION_SIGNING_KEY": str(a)})
    assert from_env.stdout.strip() == pub_a
    missing = _run("public")
    assert missing.exit_code == 2 and "RUNWATCH_ACTION_SIGNING_KEY" in missing.stderr


def test_rotate_makes_a_new_key_and_prints_both_public_keys(tmp_path):
    old = tmp_path / "old.pem"
    current = _run("generate", "--out", str(old)).stdout.strip()
    refused = _run("rotate", "--out", str(tmp_path / "x.pem"))  # nothing to keep: said, no file written
    assert refused.exit_code == 2 and "RUNWATCH_ACTION_PUBLIC_KEYS" in refused.stderr
    assert not (tmp_path / "x.pem").exists()
    new = tmp_path / "new.pem"
    done = _run("rotate", "--out", str(new), env={"RUNWATCH_ACTION_PUBLIC_KEYS": current})
    assert done.exit_code == 0, done.output
    rotation = resolve_public_keys(done.stdout.strip())
    new_key, old_key = resolve_signing_key(str(new)), resolve_signing_key(str(old))
    assert rotation.key_ids == [new_key.key_id, old_key.key_id]
    assert rotation.verify(new_key.sign(_action())) and rotation.verify(old_key.sign(_action()))
    assert stat.S_IMODE(new.stat().st_mode) == 0o600
    # the end of the rotation: the new key alone, and the old key's actions are refused
    final = resolve_public_keys(_run("public", str(new)).stdout.strip())
    assert not final.verify(old_key.sign(_action()))
