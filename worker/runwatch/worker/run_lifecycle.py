"""When a worker lets a run go that never said goodbye: silence past ``runs.silence_retention_s``, or
eviction when the worker holds ``runs.max_runs`` (docs/state.md, "Run lifecycle"). Either way the run's
detector state is dropped and an ``info`` finding of the ``run_lifecycle`` kind says why, so that a person
reading the run sees where its watch ended; what a rollback needs (its checkpoint ledger: ``RunLedger``)
is kept for ``runs.ledger_retention_s``, so a run that comes back still rolls back.

Which run eviction takes (``RunActivity.victims``), so that no producer can push a live run out by
sending run ids: first runs that never sent a step, then runs that sent nothing for ``runs.active_s``
(by their records' times, against the newest record the worker has read of their partition), then active
runs without a confirmed-good checkpoint, each the least recently active first; an active run with one
only when every run held is such a run. ``RunActivity`` keeps each of those groups in the order their latest
event arrived (by the worker's wall clock), so both checks cost O(runs let go), not O(runs held).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from itertools import islice

from runwatch.contract.schema import Anomaly

LIFECYCLE = "run_lifecycle"  # the detector name of these findings
_NAMESPACE = uuid.UUID("5f0c2a8e-93d1-4c2b-b7a4-1e6d0f3a9c55")


class RunActivity:
    """Run ids, least recently active first, with when each one's latest event arrived (the worker's
    clock) and was sent (its record's time); and, in the same order, those that never sent a step and
    those without a confirmed-good checkpoint (eviction's order)."""

    SCAN = 64  # runs looked at, least recently active first, for an inactive one to evict

    def __init__(self) -> None:
        self._arrived: OrderedDict[str, datetime] = OrderedDict()
        self._sent: dict[str, datetime] = {}
        self._unstepped: OrderedDict[str, None] = OrderedDict()
        self._unconfirmed: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._arrived)

    def seen(
        self,
        run_id: str,
        at: datetime,
        stepped: bool = True,
        confirmed: bool = False,
        sent: datetime | None = None,
    ) -> None:
        """An event of the run arrived ``at``, sent at ``sent`` (its record's time; None: ``at``);
        ``stepped``: the run has sent a step; ``confirmed``: it has a confirmed-good checkpoint."""
        self._arrived[run_id] = at
        self._arrived.move_to_end(run_id)
        self._sent[run_id] = sent or at
        for group, member in ((self._unstepped, not stepped), (self._unconfirmed, not confirmed)):
            if member:
                group[run_id] = None
                group.move_to_end(run_id)
            elif group:
                group.pop(run_id, None)

    def sent(self, run_id: str) -> datetime | None:
        """When the run's latest event was sent (its record's time)."""
        return self._sent.get(run_id)

    def forget(self, run_id: str) -> None:
        self._arrived.pop(run_id, None)
        self._sent.pop(run_id, None)
        self._unstepped.pop(run_id, None)
        self._unconfirmed.pop(run_id, None)

    def least_recent(self, count: int) -> list[str]:
        """The ``count`` least recently active runs."""
        return [run_id for run_id, _ in zip(self._arrived, range(count), strict=False)]

    def victims(self, count: int, inactive: Callable[[str], bool]) -> list[tuple[str, str]]:
        """The ``count`` runs eviction takes, with why (``never_stepped``, ``inactive``, ``unconfirmed``,
        ``least_recent``): see the module's doc. ``inactive``: whether a run has sent nothing for
        ``runs.active_s`` (judged on record times, not on when a worker behind on its input read them:
        a backlog must not make a live run look quiet); looked for among the ``SCAN`` least recent."""
        out: dict[str, str] = {}

        def take(runs: Iterable[str], why: str, keep: Callable[[str], bool] | None = None) -> None:
            for run_id in runs:
                if len(out) >= count:
                    return
                if keep is None or keep(run_id):
                    out.setdefault(run_id, why)

        take(self._unstepped, "never_stepped")
        take(islice(self._arrived, self.SCAN), "inactive", keep=inactive)
        take(self._unconfirmed, "unconfirmed")
        take(self._arrived, "least_recent")
        return list(out.items())

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
    reason: str | None = None,
) -> Anomaly:
    """The ``info`` finding that a run was let go (``why``: ``silent`` or ``evicted``; ``reason``: which of
    eviction's, in its evidence). Its id is the same however often the decision is taken again for the
    same last event (``ts``): sinks deduplicate it."""
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
        evidence={"why": why} if reason is None else {"why": why, "reason": reason},
        ts=ts,
    )


def silence_message(silent_s: float, retention_s: float, kept: bool = False) -> str:
    return (
        f"no event for {_hours(silent_s)} (retention {_hours(retention_s)}): the run went silent without "
        "run_end; the worker let it go (its state dropped, "
        + (
            "its checkpoint ledger and rollback count kept for runs.ledger_retention_s"
            if kept
            else "its snapshot deleted"
        )
        + ")"
    )


EVICTION_REASONS = {
    "never_stepped": "it had never sent a step",
    "inactive": "it was the least recently active, with no event for over {active}",
    "unconfirmed": "every run held was active and it was the least recently active without a confirmed-good "
    "checkpoint",
    "least_recent": "every run held was active with a confirmed-good checkpoint and it was the least "
    "recently active",
}


def eviction_message(
    held: int, why: str = "least_recent", active_s: float = 300.0, kept: bool = False
) -> str:
    reason = EVICTION_REASONS[why].format(active=_hours(active_s))
    return (
        f"the worker held its limit of {held} runs (runs.max_runs) and {reason}: let go (its detector state "
        "dropped; "
        + (
            "its checkpoint ledger and rollback count kept for runs.ledger_retention_s"
            if kept
            else "its snapshot deleted"
        )
        + "); an event of it starts it afresh"
    )


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.0f} s"
