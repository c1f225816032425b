"""One `runwatch up` per state folder: a lock held for the life of the stack, naming who holds it. A second
one would otherwise fail deep in the embedded store ("Cannot lock file"), naming nothing."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

LOCK_FILE = "up.lock"


class StateFolderHeld(RuntimeError):
    """Another live process holds the state folder."""


def hold(state_dir: Path) -> IO[str]:
    """Lock ``state_dir`` (made, mode 0700: the store, the keys and the logs are its owner's alone) for this
    process, until the returned file is closed or the process ends. Raises ``StateFolderHeld`` naming the
    holder's pid."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if state_dir.stat().st_uid == os.getuid():
        state_dir.chmod(0o700)  # (one made by an older runwatch was world-readable)
    handle = open(state_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise StateFolderHeld(
            f"another runwatch up (pid {holder}) holds {state_dir.resolve()}: stop it (Ctrl-C in its shell, "
            f"or kill {holder}), or give this one another --state-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
