"""HMAC-SHA256 signatures over an action's canonical body.

Both the worker (signs) and the trainer (verifies) import this, so the canonical
form is defined in one place: ``Action.body_bytes()``.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from runwatch.producer.wire.schema import Action
from runwatch.producer.wire.topics import SECRET_ENV


class MissingSecretError(RuntimeError):
    pass


MIN_SECRET_BYTES = 32  # HMAC-SHA256's key should be at least its output's size; shorter is guessable


def resolve_secret(secret: str | bytes | None = None) -> bytes:
    """The given secret, else ``$RUNWATCH_ACTION_SECRET``; refusing to run unsigned."""
    value = secret if secret is not None else os.environ.get(SECRET_ENV)
    if not value:
        raise MissingSecretError(
            f"no action secret: pass one explicitly or set {SECRET_ENV} to the same value "
            "for the worker and the trainer"
        )
    secret_bytes = value.encode() if isinstance(value, str) else value
    if len(secret_bytes) < MIN_SECRET_BYTES:
        raise MissingSecretError(
            f"the action secret is {len(secret_bytes)} bytes; at least {MIN_SECRET_BYTES} are needed "
            "(HMAC-SHA256). Generate one with: python -c 'import secrets; print(secrets.token_hex(32))' and "
            f"give {SECRET_ENV} that value for the worker, the trainers and the remediator"
        )
    return secret_bytes


def _digest(action: Action, secret: bytes) -> str:
    return hmac.new(secret, action.body_bytes(), hashlib.sha256).hexdigest()


def sign_action(action: Action, secret: bytes) -> Action:
    return action.model_copy(update={"signature": _digest(action, secret)})


def verify_action(action: Action, secret: bytes) -> bool:
    expected = _digest(action, secret)
    # Bytes, not str: compare_digest raises on non-ASCII str, and a hostile message must be
    # rejected, not crash the listener.
    return hmac.compare_digest(expected.encode(), action.signature.encode(errors="replace"))
