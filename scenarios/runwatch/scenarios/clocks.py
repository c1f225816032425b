"""Clocks for recorded scenarios: simulated wall time (recording) or real time (a live demo)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

HEARTBEAT_S = 5.0
START = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)  # every recorded run starts at this simulated time


class SimulatedClock:
    """Simulated wall time: ``advance(dt)`` moves it on and beats the heartbeat at every
    ``heartbeat_s`` boundary it crosses (with the phase the run is in at that moment)."""

    simulated = True

    def __init__(self, start: datetime = START, heartbeat_s: float = HEARTBEAT_S):
        self.start = start
        self.t = 0.0
        self.heartbeat_s = heartbeat_s
        self._next_beat = heartbeat_s
        self._heartbeat: Any = None

    def seconds(self) -> float:
        return self.t

    def now(self) -> datetime:
        return self.start + timedelta(seconds=self.t)

    def bind(self, heartbeat: Any) -> None:
        self._heartbeat = heartbeat

    def advance(self, dt: float) -> None:
        end = self.t + max(0.0, dt)
        while self._heartbeat is not None and self._next_beat <= end:
            self.t = self._next_beat
            self._heartbeat.beat()
            self._next_beat += self.heartbeat_s
        self.t = end


class WallClock:
    """Real time for a live demo: ``advance(dt)`` sleeps ``dt * scale``; the Watcher's own
    heartbeat thread beats."""

    simulated = False

    def __init__(self, scale: float = 0.01):
        self.scale = scale

    def seconds(self) -> float:
        return time.perf_counter()

    def now(self) -> datetime:
        return datetime.now(UTC)

    def bind(self, heartbeat: Any) -> None:
        pass

    def advance(self, dt: float) -> None:
        if dt > 0 and self.scale > 0:
            time.sleep(dt * self.scale)
