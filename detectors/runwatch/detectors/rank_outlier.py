"""One rank's figure far above the other ranks', step after step: a spike of that rank (issue 38).

The joined step carries, per metric, the rank with the largest figure and the other ranks' figure
(``rank_extremes``). This test scores the log of their ratio with the spike rule (robust z against the
rolling median and IQR of the ratio's own history, and a minimum ratio to that median), so ranks that differ
steadily (each on its own data) set its usual level. A chance outlier is one step of one rank, anywhere in
the world; a rank's fault (a bad shard, a corrupted batch stream) lasts: a finding needs ``patience``
steps in a row (2) on which the same rank is the outlier. Flagged steps are not learnt (a fault does not
become the ratio's usual level); a finding starts a cooldown. Critical when every step of the streak is
huge (``critical_z`` and ``critical_ratio``), as the spike rule has it.

Pure: no clock, no I/O; state pickles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runwatch.detectors.rolling_quantile import IQR_TO_SIGMA, RollingQuantiles

PATIENCE = 2  # steps in a row on which the same rank is the outlier


@dataclass
class RankOutlier:
    """A streak that makes a finding: the rank, its first step, and each step's (z, ratio to usual)."""

    rank: int
    first_step: int
    scores: list[tuple[float, float]] = field(default_factory=list)
    usual: float = 1.0  # the ratio's rolling median (its usual level) at the first step
    scale: float = 0.0  # the robust scale of its log at the first step


class RankOutlierTest:
    """``update(ratio, step, rank)`` -> a :class:`RankOutlier` when ``rank`` has been the outlier for
    ``patience`` steps in a row, else None. Thresholds are a ``SpikeConfig``'s."""

    def __init__(
        self,
        window: int,
        warmup: int,
        z_threshold: float,
        min_ratio: float,
        min_scale: float,
        cooldown_steps: int,
        patience: int = PATIENCE,
    ):
        self.warmup, self.z_threshold, self.min_ratio = warmup, z_threshold, min_ratio
        self.min_scale, self.cooldown_steps, self.patience = min_scale, cooldown_steps, patience
        self._history = RollingQuantiles(window)
        self._streak: RankOutlier | None = None
        self._last_step: int | None = None
        self._quiet_until = -1  # steps up to this one are in the cooldown

    def update(self, ratio: float, step: int, rank: int) -> RankOutlier | None:
        if not (ratio > 0 and math.isfinite(ratio)):
            return None
        x = math.log(ratio)
        follows = self._last_step is not None and step == self._last_step + 1
        self._last_step = step
        score = self._score(x) if len(self._history) >= self.warmup and step > self._quiet_until else None
        if score is None:
            self._streak = None
            self._history.update(x)
            return None
        streak = self._streak
        if streak is None or streak.rank != rank or not follows:
            median = self._history.median()
            q25, _, q75 = self._history.quartiles()
            streak = self._streak = RankOutlier(
                rank, step, usual=math.exp(median), scale=max((q75 - q25) / IQR_TO_SIGMA, self.min_scale)
            )
        streak.scores.append(score)
        if len(streak.scores) < self.patience:
            return None
        self._streak = None
        self._quiet_until = step + self.cooldown_steps
        return streak

    def _score(self, x: float) -> tuple[float, float] | None:
        """(robust z, ratio to the usual level) of ``x`` when it is an outlier, else None."""
        median = self._history.median()
        usual_ratio = math.exp(x - median)
        if usual_ratio < self.min_ratio:
            return None
        q25, _, q75 = self._history.quartiles()
        z = (x - median) / max((q75 - q25) / IQR_TO_SIGMA, self.min_scale)
        return (z, usual_ratio) if z >= self.z_threshold else None
