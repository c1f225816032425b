"""The keys of a local stack, each ``$NAME`` when set, else kept in the state folder (made on first use,
readable by its owner only):

- the action secret (``$RUNWATCH_ACTION_SECRET``, ``.runwatch/secret``), which a trainer started later
  finds with ``export RUNWATCH_ACTION_SECRET="$(cat .runwatch/secret)"``;
- the workers' state key (``$RUNWATCH_STATE_SECRET``, ``.runwatch/state-secret``), which signs the runs'
  state snapshots: the worker's alone, never given to trainers (docs/state.md)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from runwatch.producer.wire import topics
from runwatch.producer.wire.signing import resolve_secret
from runwatch.streams.worker.state import STATE_SECRET_ENV, resolve_state_secret

SECRET_FILE = "secret"
STATE_SECRET_FILE = "state-secret"


def stack_secret(state_dir: Path) -> tuple[str, Path | None]:
    """The secret, and the file it came from (None: from the environment). Raises ``MissingSecretError``
    for an environment secret that is too short."""
    given = os.environ.get(topics.SECRET_ENV)
    if given:
        resolve_secret(given)  # too short: say so now, not in the worker's log
        return given, None
    path = _kept(state_dir / SECRET_FILE)
    value = path.read_text().strip()
    resolve_secret(value)
    return value, path


def stack_state_secret(state_dir: Path, action_secret: str) -> str:
    """The workers' state key: ``$RUNWATCH_STATE_SECRET``, else the one kept in ``state_dir``. Raises
    ``MissingStateSecretError`` for one that is too short or is the action secret."""
    value = os.environ.get(STATE_SECRET_ENV) or _kept(state_dir / STATE_SECRET_FILE).read_text().strip()
    resolve_state_secret(value, action_secret=action_secret.encode())
    return value


def _kept(path: Path) -> Path:
    """``path``, holding a new random key unless it exists."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
    return path
