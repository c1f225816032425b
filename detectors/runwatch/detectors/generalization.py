"""Validation loss worsening while the training loss keeps improving (overfitting, a shift between
the training and the evaluation data, a bug in the eval path).

Per eval split, the best validation loss so far and the train loss at that eval (the mean over the
last ``train_window`` step losses before it). An eval is *worse* when its loss is above the best by
more than ``min_rel_increase`` and by more than this run's own eval noise allows: sigma comes from
the rolling mean square of second differences of log val loss (river ``Rolling(Mean)``; second
differences cancel the improving trend), and the margin is ``3 + sqrt(2 ln n)`` sigmas because the
best of n noisy evals is itself about ``sqrt(2 ln n)`` sigmas low (doubled while fewer than three
differences make the estimate, and nothing is judged before there is one). So a noisy validation set that
improves overall, or plateaus, does not trip it. ``patience`` worse evals in a row, each with the train loss
below its level at the best eval, make one finding; a new best re-arms it. Val and train both worsening is the
loss detectors' business, not this one's.
"""

from __future__ import annotations

import math
from collections import deque
from datetime import datetime

from pydantic import Field
from river import stats, utils

from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.producer.wire.schema import EvalEvent, StepEvent, TelemetryEvent


class GeneralizationConfig(Strict):
    """Validation loss worsening while training loss keeps improving (overfitting, a
    leak in the eval data...)."""

    enabled: bool = True
    min_evals: int = Field(default=3, ge=2, description="evals before any finding")
    patience: int = Field(default=2, ge=1, description="consecutive evals with val worse than its best")
    min_rel_increase: float = Field(default=0.02, ge=0, description="val above its best by this fraction")
    train_window: int = Field(
        default=50, ge=4, description="steps in the train-loss means compared across evals"
    )


NAME = "val_vs_train"
NOISE_SIGMAS = 3.0  # above the expected low bias of the best eval
NOISE_EVALS = 50  # second differences in the noise estimate


class _Split:
    def __init__(self) -> None:
        self.evals = 0
        self.best_val = math.inf
        self.best_step: int | None = None
        self.train_at_best: float | None = None
        self.last_log_vals: deque[float] = deque(maxlen=2)
        self.diff2_sq = utils.Rolling(stats.Mean, window_size=NOISE_EVALS)
        self.diffs = 0
        self.streak = 0
        self.first_worse_step: int | None = None
        self.fired = False  # once per episode: until a new best

    def noise(self) -> float:
        """Sigma of one eval's log loss: x[k] - 2 x[k-1] + x[k-2] of independent
        noise has variance 6 sigma²."""
        if self.diffs == 0:
            return math.inf  # no estimate yet: no eval can be judged worse
        # river's utils.Rolling forwards get() to the wrapped Mean through __getattr__, typed as object
        sigma = math.sqrt(self.diff2_sq.get() / 6)  # type: ignore[operator]
        return sigma if self.diffs >= 3 else 2 * sigma

    def margin(self, min_rel_increase: float) -> float:
        """How far (log units) above the best an eval must be to count as worse."""
        sigmas = NOISE_SIGMAS + math.sqrt(2 * math.log(max(self.evals, 2)))
        return max(math.log1p(min_rel_increase), sigmas * self.noise())

    def learn(self, log_val: float) -> None:
        if len(self.last_log_vals) == 2:
            self.diff2_sq.update((log_val - 2 * self.last_log_vals[1] + self.last_log_vals[0]) ** 2)
            self.diffs += 1
        self.last_log_vals.append(log_val)


class ValVsTrainDetector(Detector):
    """Validation worse than its best for ``patience`` evals while the train loss keeps improving."""

    name = NAME

    def __init__(self, config: GeneralizationConfig):
        self.config = config
        self._train: deque[float] = deque(maxlen=config.train_window)
        self._splits: dict[str, _Split] = {}

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if isinstance(event, StepEvent):
            if event.loss is not None and math.isfinite(event.loss):
                self._train.append(event.loss)
            return []
        if not isinstance(event, EvalEvent) or event.split == "train":
            return []
        if event.loss is None or not math.isfinite(event.loss) or event.loss <= 0:
            return []
        split = self._splits.get(event.split)
        if split is None:
            split = self._splits[event.split] = _Split()
        train = (
            sum(self._train) / len(self._train)
            if len(self._train) >= min(4, self.config.train_window)
            else None
        )
        finding = self._judge(split, event, train)
        split.learn(math.log(event.loss))
        return [finding] if finding is not None else []

    def _judge(self, split: _Split, event: EvalEvent, train: float | None) -> Finding | None:
        cfg = self.config
        split.evals += 1
        val = event.loss
        assert val is not None  # update() judges only evals with a finite, positive loss
        if val < split.best_val:
            split.best_val, split.best_step, split.train_at_best = val, event.step, train
            split.streak, split.first_worse_step, split.fired = 0, None, False
            return None
        margin = split.margin(cfg.min_rel_increase)
        worse = math.log(val) - math.log(split.best_val) > margin
        improving = train is not None and split.train_at_best is not None and train < split.train_at_best
        if not (worse and improving):
            split.streak, split.first_worse_step = 0, None
            return None
        split.streak += 1
        if split.first_worse_step is None:
            split.first_worse_step = event.step
        if split.fired or split.streak < cfg.patience or split.evals < cfg.min_evals:
            return None
        split.fired = True
        # (``improving`` above: both train figures are there; ``worse``: a best eval, so its step, is there)
        assert train is not None and split.train_at_best is not None and split.best_step is not None
        increase = val / split.best_val - 1
        train_trend = train / split.train_at_best - 1
        return Finding(
            detector=NAME,
            metric=f"eval_loss.{event.split}",
            step=event.step,
            rank=event.rank,
            severity="warning",
            message=(
                f"{event.split} loss {val:.4g} is {increase:.1%} above its best {split.best_val:.4g} "
                f"(step {split.best_step}) for {split.streak} evals in a row, while the train loss improved "
                f"{-train_trend:.1%} over the same time ({train:.4g}, mean of the last {len(self._train)} "
                f"steps, vs {split.train_at_best:.4g})"
            ),
            value=val,
            threshold=split.best_val * math.exp(margin),
            score=increase,
            evidence={
                "split": event.split,
                "best_val": split.best_val,
                "best_step": split.best_step,
                "rel_increase": increase,
                "required_rel_increase": math.expm1(margin),
                "consecutive_evals": split.streak,
                "first_worse_step": split.first_worse_step,
                "train_loss": train,
                "train_loss_at_best": split.train_at_best,
                "train_trend": train_trend,
                # the run went wrong after its best eval: roll back to a checkpoint up to that one
                "onset_step": split.best_step + 1,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=GeneralizationConfig,
        build=lambda d: ValVsTrainDetector(d.val_vs_train),
        view="joined",
        knob="min_rel_increase",
        summary="validation loss worsening while the training loss keeps improving",
    )
)
