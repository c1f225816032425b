"""A rank's GPU health as its heartbeats report it, for the evidence of ``straggler``, ``throughput_drift``
and ``hung_rank`` findings ("rank 2: thermal throttle since 12:04:11 (SM clock 1110 of 1980 MHz)").

Heartbeats carry ``gpu`` (wire ``GpuHealth``; the producer samples NVML on its heartbeat thread:
producer/runwatch/producer/instrument/gpu_health.py). A ``GpuHealthTracker`` per rank keeps the latest
sample, the last ``HISTORY`` samples' clock and temperature, and since when each throttle reason now active
has been: the event time of the first heartbeat of the current streak that reported it (a heartbeat that
does not report it ends the streak; one with no ``gpu`` at all says nothing and ends none).

:func:`gpu_evidence` is what a finding carries (``evidence["gpu"]``): the rank, the latest sample with its
time, the active reasons with their since-times, and the recent SM clock's range. :func:`describe` is the
message's clause: the slowing reasons (not ``gpu_idle``, ``applications_clocks``, ``display_clocks``, which
say the GPU has nothing to do or runs the clocks it was set to) in words, the earliest since-time, and the
SM clock against its maximum; for a rank with no slowing reason, its SM clock alone.

Pure and plain data (dicts, lists, strings, numbers): a run's state pickles it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from datetime import datetime
from typing import Any

from runwatch.contract.schema import HeartbeatEvent, TelemetryEvent
from runwatch.detectors.findings import Finding

HISTORY = 32  # samples remembered per rank (their time, SM clock, temperature)
# Reasons that do not slow a busy GPU down: it is idle, or runs the clocks it was set to run
NOT_SLOWING = frozenset({"gpu_idle", "applications_clocks", "display_clocks"})
# The words a message uses for a reason (the wire's names otherwise)
WORDS = {
    "sw_thermal_slowdown": "thermal throttle",
    "hw_thermal_slowdown": "hardware thermal slowdown",
    "sw_power_cap": "power cap",
    "hw_power_brake": "power brake",
    "hw_slowdown": "hardware slowdown",
    "board_limit": "board limit",
    "reliability": "reliability limit",
    "sync_boost": "sync boost",
    "other": "an unnamed clock event",
}
# (the order the message names them in: the heat first, then power, then the rest)
ORDER = tuple(WORDS)


def _time(iso: str) -> str:
    """``12:04:11`` of an ISO time (the event time, as the rank's clock gave it)."""
    try:
        return datetime.fromisoformat(iso).strftime("%H:%M:%S")
    except ValueError:
        return iso


class GpuHealthTracker:
    """One rank's GPU samples from its heartbeats (see the module doc); ``observe`` each event of the rank."""

    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None  # the newest sample's figures, with "at" (ISO event time)
        self.since: dict[str, str] = {}  # active reason -> ISO event time its streak began
        self.recent: deque[tuple[str, float | None, float | None]] = deque(maxlen=HISTORY)
        self.samples = 0
        self._at: datetime | None = None  # the newest sample's event time

    def observe(self, event: TelemetryEvent) -> None:
        if not isinstance(event, HeartbeatEvent) or event.gpu is None:
            return
        if self._at is not None and event.ts < self._at:
            return  # (an older heartbeat, redelivered late: the streaks are about the newest)
        figures = event.gpu.model_dump(exclude_none=True)
        at = event.ts.isoformat()
        reasons = [str(r) for r in figures.get("throttle_reasons", [])]
        self.since = {r: self.since.get(r, at) for r in reasons}
        self.latest = {**figures, "at": at}
        self.recent.append((at, figures.get("sm_clock_mhz"), figures.get("temperature_c")))
        self.samples += 1
        self._at = event.ts

    def evidence(self, rank: int) -> dict[str, Any] | None:
        """``evidence["gpu"]`` for a finding about this rank; None without a sample."""
        latest = self.latest
        if latest is None:
            return None
        clocks = [c for _, c, _ in self.recent if c is not None]
        out: dict[str, Any] = {
            "rank": rank,
            "latest": dict(latest),
            "throttle_since": dict(self.since),
            "slowing": [r for r in _ordered(self.since) if r not in NOT_SLOWING],
            "samples": self.samples,
        }
        if clocks:
            out["recent_sm_clock_mhz"] = {"min": min(clocks), "max": max(clocks), "samples": len(clocks)}
        return out


def _ordered(reasons: dict[str, str] | list[str]) -> list[str]:
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(reasons, key=lambda r: (rank.get(r, len(ORDER)), r))


def _clock(latest: dict[str, Any]) -> str | None:
    sm, top = latest.get("sm_clock_mhz"), latest.get("sm_clock_max_mhz")
    if sm is None:
        return None
    return f"SM clock {sm:.0f} of {top:.0f} MHz" if top else f"SM clock {sm:.0f} MHz"


def describe(evidence: dict[str, Any] | None) -> str:
    """``rank 2: thermal throttle since 12:04:11 (SM clock 1110 of 1980 MHz)``; ``rank 2: not throttled (SM
    clock 1980 of 1980 MHz)``; "" without evidence."""
    if not evidence:
        return ""
    latest, since = evidence["latest"], evidence.get("throttle_since", {})
    slowing = [r for r in evidence.get("slowing", []) if r in since]
    clock = _clock(latest)
    temp = latest.get("temperature_c")
    figures = ", ".join(f for f in (clock, f"{temp:.0f} °C" if temp is not None else None) if f)
    shown = f" ({figures})" if figures else ""
    if not slowing:
        return f"rank {evidence['rank']}: GPU not throttled{shown}" if figures else ""
    words = " and ".join(WORDS.get(r, r.replace("_", " ")) for r in slowing[:3])
    first = min(since[r] for r in slowing)
    return f"rank {evidence['rank']}: {words} since {_time(first)}{shown}"


def attach(finding: Finding, evidence: dict[str, Any] | None, separator: str = "; ") -> Finding:
    """``finding`` with ``evidence["gpu"]`` and the message's clause (as it is without evidence)."""
    if evidence is None:
        return finding
    clause = describe(evidence)
    return replace(
        finding,
        message=finding.message + (separator + clause if clause else ""),
        evidence={**finding.evidence, "gpu": evidence},
    )
