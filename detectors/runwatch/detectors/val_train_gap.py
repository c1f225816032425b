"""The gap between validation and training loss closing or inverting: validation data leaking into the
training set (a split on the wrong key, a cache shared by both), which makes the validation loss 20-30%
better than it should be. Nothing else looks wrong: both losses fall, the validation one faster.

Per eval split, the gap ``log(val loss) - log(train loss)`` at each eval (the train loss: the mean of the
last ``train_window`` step losses). Its typical level is the median of the last ``window`` gaps, its
noise the robust spread (MAD) of its changes from one eval to the next, around their median (a gap that
widens steadily as the training set is learnt is a trend, not noise). Once the typical gap is a *stable
positive* one (at least ``min_gap`` and ``stable_noises`` noise units above zero), an eval is *closed*
when the gap is down to ``1 - min_close`` of its typical level or below zero (inverted), by
``z_threshold`` noise units, while the validation loss is at a new best and fell, since the last eval
learnt, by at least half of the gap's fall (a gap that closes because the training loss rose, an LR
restart, a loss rise, harder augmentation switched on, is not a leak). ``patience`` closed evals in a row make
one finding naming the split; closed evals stay out of the history.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import EvalEvent, StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import MAD_TO_SIGMA


class ValTrainGapConfig(Strict):
    """The validation/train gap closing or inverting after a stable positive gap (a validation leak)."""

    enabled: bool = True
    min_evals: int = Field(default=5, ge=3, description="evals of gap history before any finding")
    window: int = Field(default=8, ge=3, description="evals of gap history for its typical level")
    min_gap: float = Field(
        default=0.1, gt=0, description="the typical gap (val over train, a fraction) that counts as positive"
    )
    stable_noises: float = Field(
        default=2.0, ge=0, description="the typical gap must also be this many noise units above zero"
    )
    min_close: float = Field(
        default=0.75, gt=0, le=1, description="fraction of the typical gap that must have closed"
    )
    z_threshold: float = Field(default=3.0, gt=0, description="noise units the gap must have fallen by")
    patience: int = Field(default=2, ge=1, description="consecutive closed evals before a finding")
    train_window: int = Field(default=20, ge=2, description="step losses whose mean is the train loss")


NAME = "val_train_gap"
MIN_NOISE = 0.02  # log units: the floor on the gap's noise


class _Split:
    def __init__(self, window: int) -> None:
        self.gaps: deque[float] = deque(maxlen=window)
        self.best_val = math.inf
        self.last_val: float | None = None  # log val loss at the last eval learnt into the history
        self.streak = 0
        self.since: int | None = None
        self.fired = False


class ValTrainGapDetector(Detector):
    name = NAME

    def __init__(self, config: ValTrainGapConfig):
        self.config = config
        self._train: deque[float] = deque(maxlen=config.train_window)
        self._splits: dict[str, _Split] = {}

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if isinstance(event, StepEvent):
            if event.loss is not None and math.isfinite(event.loss) and event.loss > 0:
                self._train.append(event.loss)
            return []
        if not isinstance(event, EvalEvent) or event.split == "train":
            return []
        val = event.loss
        if (
            val is None
            or not math.isfinite(val)
            or val <= 0
            or 2 * len(self._train) < self.config.train_window
        ):
            return []
        cfg = self.config
        train = sum(self._train) / len(self._train)
        gap = math.log(val) - math.log(train)
        split = self._splits.get(event.split)
        if split is None:
            split = self._splits[event.split] = _Split(cfg.window)
        new_best = val < split.best_val
        split.best_val = min(split.best_val, val)
        if len(split.gaps) < cfg.min_evals:
            split.gaps.append(gap)
            split.last_val = math.log(val)
            return []
        typical = statistics.median(split.gaps)
        noise = self._noise(split.gaps)
        stable = typical >= math.log1p(cfg.min_gap) and typical >= cfg.stable_noises * noise
        closed = gap <= typical * (1 - cfg.min_close) and typical - gap >= cfg.z_threshold * noise
        # most of the closing is the validation loss falling, not the training loss rising
        val_fell = split.last_val is not None and split.last_val - math.log(val) >= (typical - gap) / 2
        if not (stable and closed and new_best and val_fell):
            split.gaps.append(gap)
            split.last_val = math.log(val)
            split.streak, split.since, split.fired = 0, None, False
            return []
        if split.streak == 0:
            split.since = event.step
        split.streak += 1
        if split.streak < cfg.patience or split.fired:
            return []
        split.fired = True
        return [self._finding(event, split, val, train, gap, typical, noise)]

    @staticmethod
    def _noise(gaps: deque[float]) -> float:
        values = list(gaps)
        changes = [b - a for a, b in zip(values, values[1:], strict=False)]
        if len(changes) < 2:
            return MIN_NOISE
        mid = statistics.median(changes)  # the gap's own trend: widening as the training set is learnt
        return max(statistics.median(abs(c - mid) for c in changes) * MAD_TO_SIGMA, MIN_NOISE)

    def _finding(
        self,
        event: EvalEvent,
        split: _Split,
        val: float,
        train: float,
        gap: float,
        typical: float,
        noise: float,
    ) -> Finding:
        ratio, typical_ratio = math.exp(gap), math.exp(typical)
        inverted = gap < 0
        how = "inverted" if inverted else "closed"
        expected = train * typical_ratio
        better = 1 - val / expected
        return Finding(
            detector=NAME,
            metric=f"eval_loss.{event.split}",
            step=event.step,
            rank=event.rank,
            severity="warning",
            message=(
                f"{event.split} loss {val:.4g} is {ratio:.2f}x the train loss {train:.4g} (mean of the last "
                f"{len(self._train)} steps) where it was typically {typical_ratio:.2f}x: the gap {how} for "
                f"{split.streak} evals since step {split.since}, the {event.split} loss {better:.0%} "
                f"better than the usual gap predicts; {event.split} data leaking into training?"
            ),
            value=val,
            threshold=train * math.exp(typical * (1 - self.config.min_close)),
            score=(typical - gap) / noise,
            evidence={
                "split": event.split,
                "kind": "leak",
                "val_loss": val,
                "train_loss": train,
                "gap_ratio": ratio,
                "typical_gap_ratio": typical_ratio,
                "inverted": inverted,
                "expected_val_loss": expected,
                "consecutive_evals": split.streak,
                "first_closed_step": split.since,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=ValTrainGapConfig,
        build=lambda d: ValTrainGapDetector(d.val_train_gap),
        view="joined",
        knob="min_close",
        summary="the validation/train loss gap closing or inverting after a stable positive gap (a leak)",
    )
)
