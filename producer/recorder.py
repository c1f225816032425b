"""``JsonlRecorder``: the events of one rank written to a JSONL file instead of Kafka.

It builds exactly the events :class:`~runwatch.producer.publisher.RunWatch` builds (the
same base class), one wire-format JSON object per line, in order. With an injectable
``clock`` the timestamps can come from a simulated clock: a recorded scenario of minutes
of training time is then produced in seconds, and replayed by the detectors as if live.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from runwatch.producer.publisher import TelemetryPublisher
from runwatch.producer.wire.schema import CheckpointRef, EventBase


class JsonlRecorder(TelemetryPublisher):
    """Writes one rank's telemetry for one run to ``path``, one JSON event per line.

    Drop-in for :class:`RunWatch` in a training loop (``step``, ``eval``, ``heartbeat``,
    ``checkpoint``, ``watch``, ``close``). Rank 0 writes ``run_start`` at construction
    (metadata collected as ``RunWatch`` does; ``collect_metadata=False`` skips it) and
    ``run_end`` at :meth:`close`. ``clock`` gives every event's ``ts`` (default: now, UTC).
    Lines are buffered and flushed at close (and by :meth:`flush`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        run_id: str,
        rank: int = 0,
        *,
        world_size: int = 1,
        clock: Callable[[], datetime] | None = None,
        run_start: dict[str, Any] | None = None,
        config: Any = None,
        seed: int | None = None,
        dataset_version: str | None = None,
        tags: dict[str, str] | None = None,
        baseline_key: str | None = None,
        job_id: str | None = None,
        collect_metadata: bool = True,
    ):
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        self.path = Path(path)
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.clock = clock
        self.checkpoints: list[CheckpointRef] = []
        self.written = 0
        self.invalid = 0  # events dropped because their fields did not validate
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("wb")
        if rank == 0:
            self._run_start(world_size, run_start, collect_metadata, config=config, seed=seed,
                            dataset_version=dataset_version, tags=tags, baseline_key=baseline_key, job_id=job_id)

    def publish(self, event: EventBase) -> bool:
        """Write one event; False once the recorder is closed."""
        if self._closed:
            return False
        self._file.write(event.to_json() + b"\n")
        self.written += 1
        return True

    def _count_invalid(self) -> None:
        self.invalid += 1

    def flush(self) -> None:
        if not self._closed:
            self._file.flush()

    def close(self, status: str | None = None, summary: dict | None = None) -> int:
        """Close the watchers made by ``watch``, write ``run_end`` (rank 0), flush and close the file;
        returns the number of lines written. ``status`` defaults as in ``RunWatch.close``:
        ``stopped`` after an applied stop action, else ``completed``. ``with JsonlRecorder(...) as
        rec:`` picks it as ``RunWatch`` does (``failed`` when the body raised)."""
        if self._closed:
            return self.written
        self._close_watchers()
        if self.rank == 0:
            self._run_end(status, summary)
        self._closed = True
        self._file.close()
        return self.written
