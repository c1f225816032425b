"""The keys of a local stack, each ``$NAME`` when set, else kept in the state folder (made on first use,
readable by its owner only):

- the action signing key (``$RUNWATCH_ACTION_SIGNING_KEY``, ``.runwatch/action-signing-key.pem``): the
  worker's alone, it signs actions. Its public key (``$RUNWATCH_ACTION_PUBLIC_KEYS``, written into
  ``.runwatch/env``) is what a trainer started later, the sink and the remediator verify with; it
  cannot sign;
- the workers' state key (``$RUNWATCH_STATE_SECRET``, ``.runwatch/state-secret``), which signs the runs'
  state snapshots: the worker's alone, never given to trainers (docs/state.md)."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from runwatch.contract import topics
from runwatch.contract.signing import (
    ActionPublicKeys,
    ActionSigningKey,
    MissingKeyError,
    resolve_public_keys,
    resolve_signing_key,
)
from runwatch.worker.state.snapshot import STATE_SECRET_ENV, resolve_state_secret

SIGNING_KEY_FILE = "action-signing-key.pem"
STATE_SECRET_FILE = "state-secret"


@dataclass(frozen=True)
class StackActionKeys:
    """``signing_key``: the worker's ``$RUNWATCH_ACTION_SIGNING_KEY`` (the key file's absolute path, or the
    environment's value); ``signing_key_file``: the file kept in the state folder (None: from the
    environment); ``public_keys``: what the trainers, the sink and the remediator verify with."""

    signing_key: str
    signing_key_file: Path | None
    seed: bytes
    public_keys: ActionPublicKeys


def stack_action_keys(state_dir: Path) -> StackActionKeys:
    """The stack's action keys. Raises ``MissingKeyError`` for an environment key that is not usable, or
    public keys in the environment that do not hold the signing key's."""
    given = os.environ.get(topics.SIGNING_KEY_ENV)
    if given:
        key, value, path = (
            resolve_signing_key(given),
            given,
            None,
        )  # unusable: said now, not in the worker's log
    else:
        path = _kept_signing_key(state_dir / SIGNING_KEY_FILE)
        value = str(path.resolve())
        key = resolve_signing_key(value)
    public = ActionPublicKeys([key.public])
    if os.environ.get(topics.PUBLIC_KEYS_ENV):  # (a rotation's two keys, say): the worker's must be one
        public = resolve_public_keys()
        if key.key_id not in public.key_ids:
            raise MissingKeyError(
                f"{topics.PUBLIC_KEYS_ENV} does not hold the public key of the worker's signing key "
                f"({key.public.text}): every action would be refused; unset it, or add that key"
            )
    return StackActionKeys(value, path, key.seed, public)


def stack_state_secret(state_dir: Path, action_key: bytes) -> str:
    """The workers' state key: ``$RUNWATCH_STATE_SECRET``, else the one kept in ``state_dir``. Raises
    ``MissingStateSecretError`` for one that is too short or is a key of the actions'."""
    value = os.environ.get(STATE_SECRET_ENV) or _kept(state_dir / STATE_SECRET_FILE).read_text().strip()
    resolve_state_secret(value, action_secret=action_key)
    return value


def _kept(path: Path) -> Path:
    """``path``, holding a new random key unless it exists."""
    if not path.exists():
        write_private_file(path, secrets.token_hex(32) + "\n")
    return path


def _kept_signing_key(path: Path) -> Path:
    """``path``, holding a new Ed25519 private key (PEM) unless it exists."""
    if not path.exists():
        write_private_file(path, ActionSigningKey.generate().pem().decode())
    return path


def write_private_file(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others
    with os.fdopen(fd, "w") as out:
        out.write(text)
