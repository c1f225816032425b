"""``JsonlRecorder``: the events of one rank written to a JSONL file instead of Kafka.

A :class:`~runwatch.producer.publish.run_watch.RunWatch` whose delivery is a
:class:`JsonlDelivery`: exactly the events ``RunWatch`` builds, one wire-format JSON object per
line, in order. With an injectable ``clock`` the timestamps can come from a simulated clock: a
recorded scenario of minutes of training time is then produced in seconds, and replayed by the
detectors as if live.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from runwatch.contract.schema import EventBase
from runwatch.producer.publish.delivery import PublisherStats
from runwatch.producer.publish.events import require_run_id
from runwatch.producer.publish.run_watch import RunWatch


class JsonlDelivery:
    """Writes each event delivered as one JSON line to ``path`` (created, or truncated).

    Lines are buffered and flushed at :meth:`close` (and by :meth:`flush`). In ``stats`` a line
    written is ``queued`` and ``published`` at once."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.stats = PublisherStats()
        self._lock = threading.Lock()  # the heartbeat thread writes too
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("wb")

    def deliver(self, event: EventBase) -> bool:
        line = event.to_json() + b"\n"
        with self._lock:
            if self._closed:
                self._count_drop("closed")
                return False
            self._file.write(line)
            self.stats.queued += 1
            self.stats.published += 1
        return True

    def refuse(self, reason: str) -> None:
        with self._lock:
            self._count_drop(reason)

    def flush(self) -> None:
        with self._lock:
            if not self._closed:
                self._file.flush()

    def close(self, timeout: float = 0.0) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._file.close()

    def _count_drop(self, reason: str) -> None:  # under _lock
        self.stats.dropped += 1
        self.stats.drop_reasons[reason] = self.stats.drop_reasons.get(reason, 0) + 1


class JsonlRecorder(RunWatch):
    """Writes one rank's telemetry for one run to ``path``, one JSON event per line.

    Drop-in for :class:`RunWatch` in a training loop (``step``, ``eval``, ``heartbeat``,
    ``checkpoint``, ``watch``, ``close``); ``written`` counts the lines, ``invalid`` the events
    dropped because their fields did not validate (both also in ``stats``). Rank 0 writes
    ``run_start`` at construction (metadata collected as ``RunWatch`` does;
    ``collect_metadata=False`` skips it) and ``run_end`` at :meth:`close`. ``clock`` gives every
    event's ``ts`` (default: now, UTC). Lines are buffered and flushed at close (and by :meth:`flush`).
    """

    delivery: JsonlDelivery

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
        require_run_id(run_id)  # before the file is created
        super().__init__(
            run_id,
            rank=rank,
            world_size=world_size,
            clock=clock,
            run_start=run_start,
            config=config,
            seed=seed,
            dataset_version=dataset_version,
            tags=tags,
            baseline_key=baseline_key,
            job_id=job_id,
            collect_metadata=collect_metadata,
            delivery=JsonlDelivery(path),
        )

    @property
    def path(self) -> Path:
        return self.delivery.path

    @property
    def written(self) -> int:
        """Lines written so far."""
        return self.stats.published

    @property
    def invalid(self) -> int:
        """Events dropped because their fields did not validate."""
        return self.stats.drop_reasons.get("invalid", 0)

    def flush(self) -> None:
        self.delivery.flush()

    def close(  # type: ignore[override] # status first, and it returns the count of lines written
        self, status: str | None = None, summary: dict[str, Any] | None = None, timeout: float = 10.0
    ) -> int:
        """Close the watchers made by ``watch``, write ``run_end`` (rank 0), flush and close the file;
        returns the number of lines written. ``status`` defaults as in ``RunWatch.close``:
        ``stopped`` after an applied stop action, else ``completed``. ``with JsonlRecorder(...) as
        rec:`` picks it as ``RunWatch`` does (``failed`` when the body raised)."""
        super().close(timeout, status=status, summary=summary)
        return self.written
