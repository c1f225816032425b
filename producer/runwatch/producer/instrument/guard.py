"""``StepGuard``: the decision, in the trainer, to skip one optimizer update before it lands.

The worker sees a step after its update and needs a round trip to act; by then a NaN is in the
weights. The guard runs between ``backward()`` and ``optimizer.step()``, on the gradient norm the
watcher computes there anyway, and skips the update of a step whose gradient (and so its loss: a
non-finite loss back-propagates non-finite gradients) is not finite, or whose gradient norm is a hard
multiple of the recent median (a robust band: one outlier does not move it). The skip is counted and
published on the step event (``update_skipped``); whether the run must roll back stays the worker's
decision (``skipped_updates``, after a configured number of skips in a row).

A finite spike is skipped at most ``max_spike_skips`` times in a row: a norm that stays high is a new
level (an LR change, a harder phase of the data), not an outlier, and the worker judges it. A
non-finite gradient is always skipped: applying it would poison every weight.

Pure logic: the watcher hands it two numbers per step.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from runwatch.contract.schema import UpdateSkipped as SkipReason  # re-exported for the watcher

__all__ = ["GuardOptions", "SkipReason", "StepGuard"]

MEDIAN_EVERY = 10


@dataclass(frozen=True)
class GuardOptions:
    """``spike_ratio``: a gradient norm this many times the median of the last ``window`` accepted norms
    is an outlier, once ``warmup`` norms are known; ``max_spike_skips``: finite spikes skipped in a row
    at most (then the update is applied and the worker judges the level)."""

    spike_ratio: float = 10.0
    window: int = 100
    warmup: int = 20
    max_spike_skips: int = 3

    def __post_init__(self) -> None:
        if not self.spike_ratio > 1:
            raise ValueError(f"guard spike_ratio must be > 1, got {self.spike_ratio!r}")
        if self.window < 1 or self.warmup < 1 or self.warmup > self.window:
            raise ValueError(
                f"guard window ({self.window}) and warmup ({self.warmup}) must be >= 1, warmup <= window"
            )
        if self.max_spike_skips < 0:
            raise ValueError(f"guard max_spike_skips must be >= 0, got {self.max_spike_skips}")


class StepGuard:
    """Judges each step's gradient before its update; counts what it skipped."""

    def __init__(self, options: GuardOptions | None = None):
        self.options = options or GuardOptions()
        self._norms: deque[float] = deque(maxlen=self.options.window)
        self._median: float | None = None  # of _norms, recomputed every MEDIAN_EVERY accepted norms
        self._stale = 0
        self._spikes_in_a_row = 0
        self.skipped: dict[SkipReason, int] = {"nonfinite": 0, "grad_spike": 0}
        self.in_a_row = 0  # updates skipped in a row, whatever the reason

    def judge(self, grad_norm: float, nonfinite_grads: float = 0) -> SkipReason | None:
        """The reason to skip this step's update, or None to apply it (and learn its norm)."""
        if nonfinite_grads or not math.isfinite(grad_norm):
            return self._skip("nonfinite")
        limit = self.limit
        if limit is not None and grad_norm > limit and self._spikes_in_a_row < self.options.max_spike_skips:
            self._spikes_in_a_row += 1
            return self._skip("grad_spike")
        self._spikes_in_a_row = 0
        self.in_a_row = 0
        self._norms.append(grad_norm)
        self._stale += 1
        if self._stale >= MEDIAN_EVERY:  # (the band moves slowly: its median is not re-sorted every step)
            self._median = None
        return None

    @property
    def limit(self) -> float | None:
        """The gradient norm above which a step is an outlier (None while warming up)."""
        if len(self._norms) < self.options.warmup:
            return None
        if self._median is None:
            self._median, self._stale = statistics.median(self._norms), 0
        return self._median * self.options.spike_ratio

    def _skip(self, reason: SkipReason) -> SkipReason:
        self.skipped[reason] += 1
        self.in_a_row += 1
        return reason
