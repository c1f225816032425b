"""The action secret of a local stack: ``$RUNWATCH_ACTION_SECRET`` when set, else the one kept in the
state folder (made on first use, readable by its owner only), so that a trainer started later finds the
same one with ``export RUNWATCH_ACTION_SECRET="$(cat .runwatch/secret)"``."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from runwatch.producer.wire import topics
from runwatch.producer.wire.signing import resolve_secret

SECRET_FILE = "secret"


def stack_secret(state_dir: Path) -> tuple[str, Path | None]:
    """The secret, and the file it came from (None: from the environment). Raises ``MissingSecretError``
    for an environment secret that is too short."""
    given = os.environ.get(topics.SECRET_ENV)
    if given:
        resolve_secret(given)  # too short: say so now, not in the worker's log
        return given, None
    path = state_dir / SECRET_FILE
    if not path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
    value = path.read_text().strip()
    resolve_secret(value)
    return value, path
