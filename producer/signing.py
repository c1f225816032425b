"""HMAC-SHA256 signatures over an action's canonical body.

Both the worker (signs) and the trainer (verifies) import this, so the canonical
form is defined in one place: ``Action.body_bytes()``.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from runwatch.producer.schema import Action
from runwatch.producer.topics import SECRET_ENV


class MissingSecretError(RuntimeError):
    pass


def resolve_secret(secret: str | bytes | None = None) -> bytes:
    """The given secret, else ``$RUNWATCH_ACTION_SECRET``; refusing to run unsigned."""
    value = secret if secret is not None else os.environ.get(SECRET_ENV)
    if not value:
        raise MissingSecretError(
            f"no action secret: pass one explicitly or set {SECRET_ENV} to the same value "
            "for the worker and the trainer"
        )
    return value.encode() if isinstance(value, str) else value


def _digest(action: Action, secret: bytes) -> str:
    return hmac.new(secret, action.body_bytes(), hashlib.sha256).hexdigest()


def sign_action(action: Action, secret: bytes) -> Action:
    return action.model_copy(update={"signature": _digest(action, secret)})


def verify_action(action: Action, secret: bytes) -> bool:
    expected = _digest(action, secret)
    # Bytes, not str: compare_digest raises on non-ASCII str, and a hostile message must be
    # rejected, not crash the listener.
    return hmac.compare_digest(expected.encode(), action.signature.encode(errors="replace"))
