"""The shape every detector has, so the monitor, the worker and ``runwatch replay`` drive them alike.

A detector belongs to one rank of one run. ``update`` sees every telemetry event of that
rank (step, eval, heartbeat, checkpoint, ...) with ``now`` = the event's timestamp and
ignores what it does not use; ``tick(now)`` is called by a timer (online) or between
events (offline) for checks that fire on time passing. Neither touches a clock, the
network or any I/O, and the state pickles, so a worker can snapshot it.
"""

from __future__ import annotations

from datetime import datetime

from runwatch.detectors.findings import Finding
from runwatch.producer.schema import TelemetryEvent


class Detector:
    """Base class: override ``update`` and, for time-based checks, ``tick``."""

    name: str = "detector"

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        return []

    def tick(self, now: datetime) -> list[Finding]:
        return []
