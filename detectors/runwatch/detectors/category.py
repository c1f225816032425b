"""One data category's loss diverging while the run's mean loss still looks fine.

Each category is judged by its loss relative to the run's mean loss over the same steps, against
its own history of that relative level: the shared movement of training (the loss falling, an LR
change, a run-wide bump) cancels out, and a category that is always harder is not an outlier. The
statistic is a robust z of log((category loss + floor) / (mean loss + floor)) against its rolling
median and IQR (river ``RollingQuantile``'s numbers, from one sorted window per category:
``rolling_quantile.RollingQuantiles``); the floor (a quarter of the run's typical loss) keeps
a well-learned category near zero loss from turning tiny absolute noise into huge log noise. A
per-step category mean over a handful of samples is noise, so samples are pooled across steps
(count-weighted) until ``min_count`` of them make one observation.

An observation diverges when its z reaches ``z_threshold`` and its ratio to the category's typical
relative level reaches ``min_ratio``; ``patience`` such observations in a row make a finding. The
history does not learn from a diverging observation (a slow divergence must not become the new
normal), except when the other categories moved too: when the median of their ratios is up as
well, the categories' balance moved as a whole and every category learns the new level.
"""

from __future__ import annotations

import math
import statistics
from datetime import datetime

from pydantic import Field

from runwatch.detectors.base import Detector
from runwatch.detectors.cooldown import Cooldown
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import IQR_TO_SIGMA, RollingQuantiles
from runwatch.producer.wire.schema import StepEvent, TelemetryEvent


class CategoryConfig(Strict):
    """One data category's loss diverging while the mean loss still looks fine."""

    enabled: bool = True
    warmup: int = Field(default=30, ge=4, description="steps with the category before any finding")
    window: int = Field(default=100, ge=8, description="steps of history for the category's typical loss")
    z_threshold: float = Field(
        default=3.0,
        gt=0,
        description="robust z of the category's log loss (patience makes 3 a rare streak by chance)",
    )
    min_ratio: float = Field(
        default=1.5, ge=1.0, description="category loss / its typical loss must also reach this"
    )
    patience: int = Field(
        default=4, ge=1, description="consecutive observations above the threshold (not one noisy batch)"
    )
    min_count: int = Field(
        default=16,
        ge=1,
        description="samples pooled, across steps if need be, into one observation of a category",
    )
    cooldown_steps: int = Field(default=100, ge=0)


NAME = "category_divergence"
MIN_SCALE = 0.02  # floor on the robust scale (log units): a nearly constant loss is not a hair trigger
# A well-learned category's loss sits near 0, where log() turns tiny absolute noise into huge
# relative noise and hides a real divergence; losses are offset by this fraction of the run's
# typical mean loss before the log.
LOSS_FLOOR_FRACTION = 0.25


class _Category:
    __slots__ = (
        "history",
        "last_ratio",
        "onset_step",
        "pool_count",
        "pool_mean_sum",
        "pool_sum",
        "cooldown",
        "seen",
        "streak",
    )

    def __init__(self, window: int):
        self.history = RollingQuantiles(window)  # x, the log relative level
        self.seen = 0
        self.pool_sum = 0.0
        self.pool_count = 0
        self.pool_mean_sum = 0.0  # the run's mean loss over the same steps, count-weighted
        self.last_ratio: float | None = None  # latest loss / typical, for the others' run-wide check
        self.streak = 0
        self.onset_step: int | None = None
        self.cooldown = Cooldown()

    def learn(self, x: float) -> None:
        self.history.update(x)
        self.seen += 1


def _pool(
    cat: _Category, mean: float, count: int, mean_loss: float, floor: float, min_count: int
) -> tuple[float, float] | None:
    """Add a step's samples of one category (``count`` of them, averaging ``mean``, while the run's mean
    loss was ``mean_loss``) to its pool: once the pool holds ``min_count`` samples, the observation x (its
    log loss relative to the run's mean over the same steps) and that mean loss, else None. (A step that
    makes a whole observation on its own, into an empty pool, is taken without the pool by the caller.)"""
    cat.pool_sum += mean * count
    cat.pool_mean_sum += mean_loss * count
    cat.pool_count += count
    if cat.pool_count < min_count:
        return None
    # The category relative to the run's mean over the same steps: the shared trend of
    # training (a falling loss, an LR change, a run-wide bump) cancels out.
    pooled = cat.pool_count
    pooled_mean = cat.pool_mean_sum / pooled
    x = math.log(cat.pool_sum / pooled + floor) - math.log(pooled_mean + floor)
    cat.pool_sum, cat.pool_mean_sum, cat.pool_count = 0.0, 0.0, 0
    return x, pooled_mean


class CategoryDivergenceDetector(Detector):
    """Names the data category whose loss diverges from its own history while the others stay put."""

    name = NAME

    def __init__(self, config: CategoryConfig):
        self.config = config
        self._categories: dict[str, _Category] = {}
        self._mean_history = RollingQuantiles(config.window)  # log of the run's mean loss
        # ratio = exp(x - median) reaches min_ratio only if x - median reaches about log(min_ratio); the
        # margin covers exp's rounding, so this prefilter never skips an observation that diverges.
        self._log_min_ratio = math.log(config.min_ratio) - 1e-9

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent) or not event.category_loss:
            return []
        cfg = self.config
        mean_loss, mean_ratio, floor = self._observe_mean(event)

        # 1. pool each category's samples into observations; score the complete ones against history.
        # An observation that does not diverge is learnt at once (its category's history is read by no
        # other category); a diverging one waits for the others' ratios of this step.
        categories = self._categories
        min_count = cfg.min_count
        # name, state, x, the run's mean loss over the observation, z, ratio
        diverging: list[tuple[str, _Category, float, float, float, float]] = []
        warmup, log_min_ratio, inf, log, exp = cfg.warmup, self._log_min_ratio, math.inf, math.log, math.exp
        # the run's mean loss over one step, offset and logged once for every category that observes
        # within the step (most do, where categories are common: see _pool for the others)
        log_mean = log(mean_loss + floor) if mean_loss is not None else 0.0
        for name, loss in event.category_loss.items():
            count, mean = loss.count, loss.mean
            if count <= 0 or not 0.0 < mean < inf:
                continue  # non-finite losses are the non-finite detector's
            cat = categories.get(name)
            if cat is None:
                cat = categories[name] = _Category(cfg.window)
            if mean_loss is None:
                continue
            # (the pooling and the usual, quiet scoring are written out here: this loop runs for every
            # category of every step, and two calls per category were a fifth of the detector's cost)
            if cat.pool_count == 0 and count >= min_count:
                # a whole observation in one step: no pool
                pooled_mean = mean_loss
                x = log(mean + floor) - log_mean
            else:
                observed = _pool(cat, mean, count, mean_loss, floor, min_count)
                if observed is None:
                    continue
                x, pooled_mean = observed
            if cat.seen < warmup:
                cat.learn(x)
                continue
            history = cat.history
            deviation = x - history.median()
            cat.last_ratio = exp(deviation)
            if deviation >= log_min_ratio:  # only then can the ratio reach min_ratio
                scored = self._score(cat, x, deviation)
                if scored is not None:
                    diverging.append((name, cat, x, pooled_mean, *scored))
                    continue
            history.update(x)
            cat.seen += 1
            cat.streak, cat.onset_step = 0, None

        # 2. a divergence is one category's, not the run's: the others' median ratio must stay low
        found: list[Finding] = []
        for name, cat, x, pooled_mean, z, ratio in diverging:
            others_ratio = self._others_ratio(name)
            if others_ratio is None or others_ratio >= 1.0 + (cfg.min_ratio - 1.0) / 2:
                cat.learn(x)
                cat.streak, cat.onset_step = 0, None
                continue
            cat.streak += 1
            if cat.onset_step is None:
                cat.onset_step = event.step
            if cat.streak < cfg.patience or cat.cooldown.active(event.step):
                continue
            cat.cooldown.start(event.step, cfg.cooldown_steps)
            found.append(self._finding(event, name, cat, x, pooled_mean, z, ratio, others_ratio, mean_ratio))
        return found

    def _observe_mean(self, event: StepEvent) -> tuple[float | None, float | None, float]:
        """Learn the step's mean loss: ``(mean loss, its ratio to its typical level before this step, the
        loss floor)``, the first two None when unknown; the floor is a quarter of the run's typical loss,
        which offsets the losses before the log (see the module doc)."""
        mean_loss = self._mean_loss(event)
        mean_ratio = None
        typical_mean = self._mean_history.get(0.5)
        if mean_loss is not None:
            log_mean = math.log(mean_loss)
            if typical_mean is not None:
                mean_ratio = math.exp(log_mean - typical_mean)
            self._mean_history.update(log_mean)
            typical_mean = self._mean_history.get(0.5)
        floor = LOSS_FLOOR_FRACTION * math.exp(typical_mean) if typical_mean is not None else 0.0
        return mean_loss, mean_ratio, floor

    def _score(self, cat: _Category, x: float, deviation: float) -> tuple[float, float] | None:
        """``(robust z, ratio)`` of an observation ``x`` whose ``deviation`` from its category's typical
        level is large enough for the ratio to reach ``min_ratio``, when it diverges (it is not learnt
        then: it waits for the other categories' ratios); else None."""
        cfg = self.config
        q25, _, q75 = cat.history.quartiles()
        scale = max((q75 - q25) / IQR_TO_SIGMA, MIN_SCALE)
        z = deviation / scale
        ratio = math.exp(deviation)
        if z >= cfg.z_threshold and ratio >= cfg.min_ratio:
            return z, ratio
        return None

    def _others_ratio(self, name: str) -> float | None:
        others = [c.last_ratio for n, c in self._categories.items() if n != name and c.last_ratio is not None]
        return statistics.median(others) if others else None

    def _floor(self) -> float:
        typical_log_mean = self._mean_history.get(0.5)
        return LOSS_FLOOR_FRACTION * math.exp(typical_log_mean) if typical_log_mean is not None else 0.0

    @staticmethod
    def _mean_loss(event: StepEvent) -> float | None:
        if event.loss is not None and math.isfinite(event.loss) and event.loss > 0:
            return event.loss
        total = sum(c.count for c in event.category_loss.values() if math.isfinite(c.mean))
        if total <= 0:
            return None
        mean = sum(c.mean * c.count for c in event.category_loss.values() if math.isfinite(c.mean)) / total
        return mean if mean > 0 else None

    def _finding(
        self,
        event: StepEvent,
        name: str,
        cat: _Category,
        x: float,
        pooled_mean: float,
        z: float,
        ratio: float,
        others_ratio: float | None,
        mean_ratio: float | None,
    ) -> Finding:
        cfg = self.config
        floor = self._floor()
        median = cat.history.get(0.5)
        assert median is not None  # a category is judged only past its warm-up
        # In losses, not log-space levels: the observation's loss, and the loss the category would have
        # at its typical level relative to the run's mean loss over the same steps.
        typical = math.exp(median) * (pooled_mean + floor) - floor
        loss = math.exp(x) * (pooled_mean + floor) - floor
        loss_ratio = loss / typical if typical > 0 else math.inf
        mean_part = f"; the mean loss is at {mean_ratio:.2f}x its typical" if mean_ratio is not None else ""
        return Finding(
            detector=NAME,
            metric=f"category_loss.{name}",
            step=event.step,
            rank=event.rank,
            severity="warning",
            message=(
                f"category {name!r} loss diverges: {loss:.4g} is {loss_ratio:.2f}x its typical {typical:.4g} "
                f"(robust z {z:.1f}) for {cat.streak} observations since step {cat.onset_step}, while the "
                f"other categories are at {others_ratio:.2f}x theirs{mean_part}"
            ),
            value=loss,
            threshold=typical * cfg.min_ratio,
            score=z,
            evidence={
                "category": name,
                "typical_loss": typical,
                "ratio": ratio,  # of the losses offset by the floor, which min_ratio bounds
                "loss_ratio": loss_ratio,
                "robust_z": z,
                "consecutive": cat.streak,
                "onset_step": cat.onset_step,
                "others_median_ratio": others_ratio,
                "mean_loss_ratio": mean_ratio,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=CategoryConfig,
        build=lambda d: CategoryDivergenceDetector(d.category_divergence),
        view="joined",
        knob="z_threshold",
        summary="one data category's loss diverging while the mean still looks fine",
    )
)
