"""The finding about a rank whose clock is ahead of the worker's (``RunMonitor.clock_seen``)."""

from __future__ import annotations

from runwatch.detectors.findings import Finding

CLOCK_SKEW = "clock_skew"  # the finding's detector
MAX_CLOCK_RANKS = 64  # ranks whose clock offsets a run's actions carry at most


def clock_skew_finding(rank: int, ahead_s: float, step: int | None, max_future_s: float) -> Finding:
    """``rank``'s clock is ``ahead_s`` seconds ahead, more than the ``max_future_s`` a record may be."""
    return Finding(
        detector=CLOCK_SKEW,
        metric="clock",
        step=step,
        rank=rank,
        severity="warning",
        value=round(ahead_s, 1),
        threshold=max_future_s,
        message=(
            f"rank {rank}'s clock is {ahead_s:.0f} s ahead of the worker's (more than the "
            f"{max_future_s:.0f} s a record may be ahead): its event times are moved "
            "back by that much and its actions say so; put the host's clock right (NTP)"
        ),
        evidence={"ahead_s": round(ahead_s, 1)},
    )
