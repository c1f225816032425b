"""The ids of the actions a rank acknowledged (applied or failed), kept across restarts.

Written to a small per-rank state file, by default beside the rank's spool directory,
``$RUNWATCH_SPOOL_DIR/<run_id>-r<rank>.actions`` (the listener's ``state_path=`` chooses another
file, one per rank; ``state_path=False`` keeps nothing). It is rewritten atomically (temporary
file, fsync, rename) before the acknowledgement is sent and keeps the newest ``state_max_ids``
ids. A listener started with the file loads it, so an action redelivered to a restarted trainer
(which the start-time allowance would accept) is not applied twice.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from runwatch.producer.publish.kafka_delivery import default_spool_dir

if TYPE_CHECKING:
    from runwatch.producer.publish.publisher import ActionPublisher

log = logging.getLogger(__name__)

STATE_SUFFIX = ".actions"
STATE_MAX_IDS = 10_000  # applied action ids kept in the state file (the newest)


def default_state_path(rw: ActionPublisher) -> Path:
    """Where a listener keeps the ids of the actions it applied: beside the rank's spool directory
    (``rw.spool_path``, else :func:`~runwatch.producer.publish.kafka_delivery.default_spool_dir`), with
    ``.actions`` appended to its name."""
    spool = rw.spool_path
    base = Path(spool) if spool is not None else default_spool_dir(rw.run_id, rw.rank)
    return base.with_name(base.name + STATE_SUFFIX)


class AppliedIds:
    """The ids of the actions a rank acknowledged, newest last, kept in a JSON file that is
    rewritten atomically (temporary file, fsync, rename) and bounded to the newest ``max_ids``.
    ``path=None``: in memory only. Never raises into training: a file that cannot be read or
    written is logged (and ``errors`` counts it), and the listener goes on without it."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        max_ids: int = STATE_MAX_IDS,
        *,
        run_id: str = "",
        rank: int = 0,
    ):
        if max_ids < 1:
            raise ValueError(f"state_max_ids must be at least 1, got {max_ids}")
        self.path = Path(path).resolve() if path is not None else None
        self.max_ids = max_ids
        self.errors = 0
        self._run_id, self._rank = run_id, rank
        self._ids: dict[str, None] = {}  # insertion-ordered: oldest first
        self._lock = threading.Lock()
        self.loaded = self._load()

    def __contains__(self, action_id: object) -> bool:
        with self._lock:
            return action_id in self._ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def add(self, *action_ids: str) -> None:
        """Remember ``action_ids`` and write the file before returning."""
        with self._lock:
            for action_id in action_ids:
                self._ids.pop(action_id, None)
                self._ids[action_id] = None
            while len(self._ids) > self.max_ids:
                del self._ids[next(iter(self._ids))]
            self._write()

    def _load(self) -> int:
        if self.path is None:
            return 0
        try:
            data = json.loads(self.path.read_bytes())
            ids = data["applied"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError("'applied' is not a list of strings")
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable, not JSON, or not its shape
            self.errors += 1
            log.warning(
                "runwatch: cannot read the applied actions in %s (%r); starting without them", self.path, exc
            )
            return 0
        for action_id in ids[-self.max_ids :]:
            self._ids[action_id] = None
        return len(self._ids)

    def _write(self) -> None:
        if self.path is None:
            return
        body = json.dumps({"run_id": self._run_id, "rank": self._rank, "applied": list(self._ids)}).encode()
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            with contextlib.suppress(OSError):  # the rename itself survives a crash too
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as exc:
            self.errors += 1
            log.warning(
                "runwatch: cannot write the applied actions to %s (%r); a restarted trainer may "
                "apply them again",
                self.path,
                exc,
            )
            with contextlib.suppress(OSError):
                tmp.unlink()
