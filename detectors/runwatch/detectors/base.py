"""The shape every detector has, so the monitor, the worker and ``runwatch replay`` drive them alike.

A detector belongs to one view of one run (``registry.View``). ``update(event, now)`` sees the
events of its view with ``now`` = the event's timestamp and ignores what it does not use: a rank
detector every telemetry event of its rank (step, eval, heartbeat, checkpoint, and the run's end), a
joined-view detector the run's joined steps and evals, a cross-rank detector (``CrossRankDetector``)
every rank's events and each joined step's record. ``tick(now)`` is called by a timer (online) or
between events (offline) for checks that fire on time passing. Neither touches a clock, the network
or any I/O, and the state pickles, so a worker can snapshot it.
"""

from __future__ import annotations

from datetime import datetime

from runwatch.contract.schema import JoinedStep, TelemetryEvent
from runwatch.detectors.findings import Finding


class Detector:
    """Base class: override ``update`` and, for time-based checks, ``tick``."""

    name: str = "detector"

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        return []

    def tick(self, now: datetime) -> list[Finding]:
        return []


class CrossRankDetector(Detector):
    """A detector that compares ranks: ``update`` sees every rank's events and, once a step is joined
    across the ranks (complete, or timed out), its ``JoinedStep`` record."""

    def update(self, event: TelemetryEvent | JoinedStep, now: datetime) -> list[Finding]:
        return []
