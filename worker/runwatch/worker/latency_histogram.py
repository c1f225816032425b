"""The worker's detection latency as histogram buckets: from the event time of what a finding is about
(its step's, or the tick's) to the broker's acknowledgement of the finding's record, as
tests/benchmarks/bench_latency.py measures the path end to end. Observed by the event loop once per
finding; read by the metrics endpoint's thread at scrape time (metrics_server.py) without a lock: a scrape
may see one observation's count before its sum, never a torn number (the GIL). ``listeners`` are handed
each observation too (the OTLP exporter's SDK histogram, otlp_export.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

# Seconds: the pipeline's own latency is tens of milliseconds; findings judged late (a backlog read after
# a restart, a slow broker) reach minutes.
BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class LatencyHistogram:
    def __init__(self, bounds: tuple[float, ...] = BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (not cumulative); the last: over every bound
        self.sum = 0.0
        self.listeners: list[Callable[[float], None]] = []  # (added before the worker runs)

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)  # (an event time a little ahead of the worker's clock)
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1  # (the first bound >= seconds: ``le``)
        self.sum += seconds
        for listener in self.listeners:
            listener(seconds)

    def observe_since(self, event_times: Iterable[float], now: float) -> None:
        for ts in event_times:
            self.observe(now - ts)

    def cumulative(self) -> tuple[list[tuple[str, int]], int, float]:
        """(``le`` bound, cumulative count) pairs ending with ``+Inf``, the count and the sum."""
        counts, total = list(self.counts), self.sum
        buckets, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return buckets, running, total
