"""Validation loss worsening while the training loss keeps improving (overfitting, a shift between
the training and the evaluation data, a bug in the eval path).

Per eval split, the best validation loss so far and the train loss at that eval (the mean over the
last ``train_window`` step losses before it). An eval is *worse* when its loss is above the best by
more than ``min_rel_increase`` and by more than this run's own eval noise allows. ``patience`` worse
evals in a row, each with the train loss below its level at the best eval, make one finding; a new
best re-arms it. Val and train both worsening is the loss detectors' business, not this one's.

The noise is the evals' residuals around their trend, not their raw spread: sigma of one eval's log
loss is the root mean square of third differences of log val loss over the last ``NOISE_EVALS`` evals
(a local quadratic trend cancels, so the steep, bending curve of the early evals is not taken for
noise, as second differences took it). Worse evals, the ones under test, join the estimate only once
their streak ends, so a turn or a jump does not widen the noise it is tested against. The margin is
``3.5 + sqrt(2 ln n)`` sigmas, because the best of n noisy evals is itself about ``sqrt(2 ln n)``
sigmas low. While fewer than five differences make the estimate, its 3.5 is Student's t's 99% quantile
at their effective degrees of freedom instead (k overlapping third differences carry about 1, 1.3, 1.7,
2.1 for k = 1..4: from few evals a tail quantile is a wide one), and nothing is judged before there is
an estimate. So a noisy
validation set that improves overall, or plateaus, does not trip it, and a few percent is enough where
the evals are smooth.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import EvalEvent, StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register


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
NOISE_SIGMAS = 3.5  # above the expected low bias of the best eval
NOISE_EVALS = 50  # the latest evals whose residuals make the noise estimate
THIRD_DIFF_VARIANCE = 20  # x[k] - 3 x[k-1] + 3 x[k-2] - x[k-3] of independent noise: 20 sigma²
# Under FEW_DIFFERENCES the estimate is a rough one. Its quantile for k = 1..4 differences is Student's t's
# 99% one at their effective degrees of freedom, (sum of eigenvalues)² / sum of squares of the eigenvalues of
# the covariance of k overlapping third differences (Satterthwaite): 1.0, 1.28, 1.66, 2.07.
FEW_DIFFERENCE_QUANTILES = (31.8, 15.9, 9.3, 6.7)
FEW_DIFFERENCES = len(FEW_DIFFERENCE_QUANTILES) + 1


def noise_quantile(differences: int) -> float:
    """Sigmas of the noise estimate an eval must clear (before the best eval's own low bias): a wider one
    while the estimate rests on few differences, never under NOISE_SIGMAS."""
    if differences >= FEW_DIFFERENCES:
        return NOISE_SIGMAS
    return max(NOISE_SIGMAS, FEW_DIFFERENCE_QUANTILES[differences - 1])


def third_diff_noise(log_vals: Iterable[float]) -> tuple[float, int] | None:
    """Sigma of one eval's log loss from its residuals around a local quadratic trend, and the number of
    differences it comes from (None under four evals)."""
    x = list(log_vals)
    diffs = [x[k] - 3 * x[k - 1] + 3 * x[k - 2] - x[k - 3] for k in range(3, len(x))]
    if not diffs:
        return None
    return math.sqrt(sum(d * d for d in diffs) / len(diffs) / THIRD_DIFF_VARIANCE), len(diffs)


class _Split:
    log_vals: deque[float] | None = None  # the log losses the noise comes from (NOISE_EVALS)
    held: list[float] | None = None  # worse evals' log losses, learnt once their streak ends

    def __init__(self) -> None:
        self.evals = 0
        self.best_val = math.inf
        self.best_step: int | None = None
        self.train_at_best: float | None = None
        self.log_vals = deque(maxlen=NOISE_EVALS)
        self.held = []
        self.streak = 0
        self.first_worse_step: int | None = None
        self.fired = False  # once per episode: until a new best

    def learnt(self) -> deque[float]:
        if self.log_vals is None:  # pickled before it kept log losses (it then had only a running mean)
            self.log_vals = deque(maxlen=NOISE_EVALS)
        return self.log_vals

    def held_back(self) -> list[float]:
        if self.held is None:  # pickled before it held worse evals back
            self.held = []
        return self.held

    def noise(self) -> tuple[float, int] | None:
        """Sigma of one eval's log loss and the differences it comes from (None: no eval can be judged)."""
        return third_diff_noise(self.learnt())

    def margin(self, min_rel_increase: float) -> float:
        """How far (log units) above the best an eval must be to count as worse (inf: no estimate yet)."""
        noise = self.noise()
        if noise is None:
            return math.inf
        sigma, differences = noise
        sigmas = noise_quantile(differences) + math.sqrt(2 * math.log(max(self.evals, 2)))
        return max(math.log1p(min_rel_increase), sigmas * sigma)

    def learn(self, log_val: float) -> None:
        """A worse eval waits while its streak lasts (it is under test, not noise); any other is learnt,
        after the ones that waited."""
        self.held_back().append(log_val)
        if self.streak == 0 or self.fired:
            self.learnt().extend(self.held_back())
            self.held_back().clear()


class ValVsTrainDetector(Detector):
    """Validation worse than its best, beyond its eval noise, for ``patience`` evals while the train loss
    keeps improving."""

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
        return self._finding(split, event, train, margin)

    def _finding(self, split: _Split, event: EvalEvent, train: float | None, margin: float) -> Finding:
        # (``_judge`` fires only with both train figures and a best eval, so its step, there)
        assert train is not None and split.train_at_best is not None and split.best_step is not None
        val = event.loss
        assert val is not None
        increase = val / split.best_val - 1
        train_trend = train / split.train_at_best - 1
        noise = split.noise()
        eval_noise = math.expm1(noise[0]) if noise is not None else math.nan
        return Finding(
            detector=NAME,
            metric=f"eval_loss.{event.split}",
            step=event.step,
            rank=event.rank,
            severity="warning",
            message=(
                f"{event.split} loss {val:.4g} is {increase:.1%} above its best {split.best_val:.4g} "
                f"(step {split.best_step}), and more than {math.expm1(margin):.1%} above it (what this "
                f"run's eval noise of \u00b1{eval_noise:.1%} allows) for {split.streak} evals in a row, "
                f"while the train loss improved {-train_trend:.1%} over the same time ({train:.4g}, mean "
                f"of the last {len(self._train)} steps, vs {split.train_at_best:.4g})"
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
                "eval_noise": eval_noise,
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
