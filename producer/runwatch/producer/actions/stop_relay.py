"""A stop, passed from the rank of a node that reads the action topic to the node's other ranks.

Under rank sync one rank per node reads the action topic (the one with ``LOCAL_RANK`` 0; rank 0 always):
a job of 16,384 ranks is then as many consumers as nodes, not 16,384 of one partition (issue 36). The
others apply rank 0's copies, which reach them through the process group at ``poll()``. A rank that is
hung, or blocked in a collective, never polls, and a stop must still end it: so the reader of a node,
receiving a stop, drops a marker file in a node-local folder, and every other rank of the node looks for
it (a ``stat`` every half second) and arms its stop watchdog, as its own consumer would have.

The marker names the run (not its attempt: ranks other than 0 may name none); one older than the
listener that watches for it (an earlier attempt or job on the node) is not taken.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

DIR_ENV = "RUNWATCH_STOP_RELAY_DIR"  # a node-local folder every rank of a node shares (default: the temp dir)
CHECK_EVERY_S = 0.5


class StopRelay:
    def __init__(self, run_id: str, folder: str | os.PathLike[str] | None = None):
        folder = Path(folder or os.environ.get(DIR_ENV) or tempfile.gettempdir())
        name = hashlib.sha256(run_id.encode()).hexdigest()[:24]
        self.path = folder / f"runwatch-stop-{name}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def signal(self, action_id: str) -> None:
        """This node's reader received a stop: tell the node's other ranks (atomic: a rename)."""
        try:
            part = self.path.with_name(f"{self.path.name}.{os.getpid()}.part")
            part.write_text(action_id)
            os.replace(part, self.path)
        except OSError as exc:  # the other ranks then stop at their next poll, or when the job fails
            log.warning(
                "runwatch: cannot pass a stop to this node's other ranks through %s: %s", self.path, exc
            )

    def watch(self, on_stop: Callable[[], None], since: float | None = None) -> None:
        """Call ``on_stop`` once, from a daemon thread, when a marker newer than ``since`` (a
        ``time.time()``; default now) appears."""
        not_before = time.time() - 1.0 if since is None else since
        self._thread = threading.Thread(
            target=self._watch, args=(on_stop, not_before), name="runwatch-stop-relay", daemon=True
        )
        self._thread.start()

    def _watch(self, on_stop: Callable[[], None], not_before: float) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            try:
                if self.path.stat().st_mtime >= not_before:
                    log.info("runwatch: this node's reader received a stop (%s)", self.path)
                    on_stop()
                    return
            except OSError:
                continue  # (none yet)

    def close(self) -> None:
        self._stop.set()
