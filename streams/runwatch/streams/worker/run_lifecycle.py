"""When a worker lets a run go that never said goodbye: silence past ``runs.silence_retention_s``, or
eviction of the least recently active run when the worker holds ``runs.max_runs`` (docs/state.md, "Run
lifecycle"). Either way the run's state is dropped, its snapshot tombstoned, and an ``info`` finding of
the ``run_lifecycle`` kind says why, so that a person reading the run sees where its watch ended.

``RunActivity`` keeps the runs in the order their latest event arrived (by the worker's wall clock):
the least recently active is always first, so both checks cost O(runs let go), not O(runs held).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta

from runwatch.producer.wire.schema import Anomaly

LIFECYCLE = "run_lifecycle"  # the detector name of these findings
_NAMESPACE = uuid.UUID("5f0c2a8e-93d1-4c2b-b7a4-1e6d0f3a9c55")


class RunActivity:
    """Run ids, least recently active first, with when each one's latest event arrived."""

    def __init__(self) -> None:
        self._arrived: OrderedDict[str, datetime] = OrderedDict()

    def __len__(self) -> int:
        return len(self._arrived)

    def seen(self, run_id: str, at: datetime) -> None:
        self._arrived[run_id] = at
        self._arrived.move_to_end(run_id)

    def forget(self, run_id: str) -> None:
        self._arrived.pop(run_id, None)

    def least_recent(self, count: int) -> list[str]:
        """The ``count`` least recently active runs."""
        out: list[str] = []
        for run_id in self._arrived:
            if len(out) >= count:
                break
            out.append(run_id)
        return out

    def silent(self, now: datetime, retention: timedelta, skip: Iterable[str] = ()) -> Iterator[str]:
        """Runs whose latest event arrived more than ``retention`` before ``now``, but those in ``skip``."""
        skipped = set(skip)
        for run_id, arrived in self._arrived.items():
            if now - arrived <= retention:
                return  # every later one arrived later still
            if run_id not in skipped:
                yield run_id


def lifecycle_finding(
    run_id: str,
    why: str,
    message: str,
    *,
    step: int | None,
    ts: datetime,
    value: float | None = None,
    threshold: float | None = None,
) -> Anomaly:
    """The ``info`` finding that a run was let go (``why``: ``silent`` or ``evicted``). Its id is the same
    however often the decision is taken again for the same last event (``ts``): sinks deduplicate it."""
    anomaly_id = uuid.uuid5(_NAMESPACE, f"{run_id}|{why}|{ts.isoformat()}").hex
    return Anomaly(
        anomaly_id=anomaly_id,
        run_id=run_id,
        step=step,
        detector=LIFECYCLE,
        metric=why,
        value=value,
        threshold=threshold,
        severity="info",
        message=message,
        evidence={"why": why},
        ts=ts,
    )


def silence_message(silent_s: float, retention_s: float) -> str:
    return (
        f"no event for {_hours(silent_s)} (retention {_hours(retention_s)}): the run went silent without "
        "run_end; the worker let it go (its state dropped, its snapshot deleted)"
    )


def eviction_message(held: int) -> str:
    return (
        f"the worker held its limit of {held} runs (runs.max_runs) and this was the least recently active: "
        "let go (its state dropped, its snapshot deleted); an event of it starts it afresh"
    )


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.0f} s"
