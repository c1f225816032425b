"""Upward spikes in a positive, heavy-tailed metric (loss, grad norm).

Robust z of log(value) against a rolling median and IQR (river ``RollingQuantile``'s numbers,
from one sorted window: ``rolling_quantile.RollingQuantiles``),
which tolerates the heavy tails of grad norms far better than a mean/std scorer.
A finding needs both the z threshold and a minimum ratio to the median, so a very
flat series does not turn noise into alarms.
"""

from __future__ import annotations

import math

from runwatch.detectors.config import SpikeConfig
from runwatch.detectors.findings import Finding
from runwatch.detectors.rolling_quantile import RollingQuantiles

IQR_TO_SIGMA = 1.349  # IQR of a standard normal


class SpikeDetector:
    def __init__(self, name: str, metric: str, config: SpikeConfig):
        self.name = name
        self.metric = metric
        self.config = config
        self._history = RollingQuantiles(config.window)  # log values
        self.seen = 0
        self._quiet_until = -1
        self._quiet_from = 0  # the cooldown covers [_quiet_from, _quiet_until]: a rollback's replay is outside it

    def update(self, value: float | None, step: int, rank: int | None = None) -> Finding | None:
        if value is None or not math.isfinite(value) or value <= 0:
            return None  # non-finite values belong to the non-finite detector
        x = math.log(value)
        finding = None
        if self.seen >= self.config.warmup and not self._quiet_from <= step <= self._quiet_until:
            finding = self._score(x, value, step, rank)
        self._history.update(x)
        self.seen += 1
        if finding is not None:
            self._quiet_from, self._quiet_until = step + 1, step + self.config.cooldown_steps
        return finding

    def _score(self, x: float, value: float, step: int, rank: int | None) -> Finding | None:
        median = self._history.get(0.5)
        ratio = math.exp(x - median)
        if ratio < self.config.min_ratio:
            return None  # (the usual case: no need for the quartiles)
        q25, _, q75 = self._history.quartiles()
        scale = max((q75 - q25) / IQR_TO_SIGMA, self.config.min_scale)
        z = (x - median) / scale
        if z < self.config.z_threshold:
            return None
        typical = math.exp(median)
        return Finding(
            detector=self.name,
            metric=self.metric,
            step=step,
            rank=rank,
            severity="critical" if z >= self.config.critical_z else "warning",
            value=value,
            threshold=typical * math.exp(self.config.z_threshold * scale),
            score=z,
            message=f"{self.metric} spiked to {value:.4g}, {ratio:.1f}x its rolling median {typical:.4g} (robust z {z:.1f})",
            evidence={"rolling_median": typical, "ratio": ratio, "robust_scale_log": scale, "window": self.config.window},
        )
