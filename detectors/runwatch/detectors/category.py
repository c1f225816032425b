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

A second, slower test (issue 37, item 5) reads the category's spread where the step carries it
(``CategoryLoss.sumsq`` and ``tail_count``): a category near chance loss whose wrong labels move its
mean 1.2-1.4x, within the drift of its level relative to the others. Its samples are pooled into
observations of ``spread_count``; each gives the category's own mean loss as a z against its own
typical level (raised with the run's mean loss where that rose above its typical) in units of its
typical per-sample spread (``sqrt(sumsq / count - mean**2)``, so the scale is the samples', not the
drift of the observations). A CUSUM of that z less ``spread_allowance``
adds up while the category is also up relative to the run's mean loss (``spread_min_ratio``) and the
median of the other categories' latest z stays under 1 (a run-wide rise is not one category's); the
finding needs the CUSUM at ``spread_threshold`` and the category's share of its samples above the
batch's 90th percentile since the CUSUM started at a binomial z of ``spread_tail_z`` above its typical
share (its samples crowd the batch's worst tenth). The typical levels (rolling medians of
``spread_window`` observations) learn only while the CUSUM is near zero.
"""

from __future__ import annotations

import math
import statistics
from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.cooldown import Cooldown
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import IQR_TO_SIGMA, RollingQuantiles


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
    spread: bool = Field(
        default=True, description="the second test, on the category's spread (sumsq, tail_count)"
    )
    spread_count: int = Field(
        default=48, ge=8, description="samples pooled into one observation of the spread test"
    )
    spread_window: int = Field(
        default=30, ge=8, description="observations of history for the spread test's typical levels"
    )
    spread_warmup: int = Field(default=10, ge=4, description="observations before the spread test judges")
    spread_allowance: float = Field(
        default=1.0, gt=0, description="z the spread test's CUSUM subtracts per observation"
    )
    spread_threshold: float = Field(
        default=7.0, gt=0, description="the spread test's CUSUM of the category's own-level z"
    )
    spread_min_ratio: float = Field(
        default=1.1,
        ge=1.0,
        description="the category's loss relative to the mean, over its typical, to add up",
    )
    spread_tail_z: float = Field(
        default=2.0, gt=0, description="binomial z of the category's tail share over its typical share"
    )


NAME = "category_divergence"
MIN_SCALE = 0.02  # floor on the robust scale (log units): a nearly constant loss is not a hair trigger
# A well-learned category's loss sits near 0, where log() turns tiny absolute noise into huge
# relative noise and hides a real divergence; losses are offset by this fraction of the run's
# typical mean loss before the log.
LOSS_FLOOR_FRACTION = 0.25
# The spread test (module doc): its scale is at least this fraction of the category's level (a category
# whose samples all score alike is not a hair trigger); the others' median z under this lets a category's
# own-level evidence add up (above it, the run moved, not the category); a typical tail share is held
# this far from 0 and 1 (a binomial z needs both sides).
SPREAD_MIN_SIGMA = 0.05
SPREAD_OTHERS_Z = 1.0
SPREAD_MIN_SHARE = 0.02


class _Spread:
    """One category's state in the spread test."""

    __slots__ = (
        "cusum",
        "last_z",
        "level",
        "onset_step",
        "pool",
        "relative",
        "run_mean",
        "seen",
        "sigma",
        "tail_count",
        "tail_n",
        "tail_share",
    )

    def __init__(self, window: int):
        self.level = RollingQuantiles(window)  # the category's own mean loss per observation
        self.sigma = RollingQuantiles(window)  # its per-sample standard deviation
        self.relative = RollingQuantiles(window)  # log loss relative to the run's mean (offset by the floor)
        self.tail_share = RollingQuantiles(window)  # its samples' share above the batch's 90th percentile
        self.run_mean = RollingQuantiles(window)  # the run's mean loss over the same observations
        self.seen = 0
        self.pool = [0.0, 0.0, 0.0, 0.0, 0.0]  # count, sum, sum of squares, tail count, run mean x count
        self.cusum = 0.0
        self.last_z: float | None = None
        self.onset_step: int | None = None
        self.tail_n = 0  # samples and tail samples since the CUSUM left zero
        self.tail_count = 0

    def learn(self, mean: float, sigma: float, x: float, share: float, run_mean: float) -> None:
        self.level.update(mean)
        self.run_mean.update(run_mean)
        self.sigma.update(sigma)
        self.relative.update(x)
        self.tail_share.update(share)
        self.seen += 1


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
        self._spread: dict[str, _Spread] = {}
        self._log_spread_ratio = math.log(config.spread_min_ratio)

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
            # x against the category's typical level, learnt at once unless the ratio may reach min_ratio
            deviation = cat.history.learn_if_below(x, log_min_ratio)
            cat.last_ratio = exp(deviation)
            if deviation >= log_min_ratio:  # only then can the ratio reach min_ratio
                scored = self._score(cat, x, deviation)
                if scored is not None:
                    diverging.append((name, cat, x, pooled_mean, *scored))
                    continue
                cat.history.update(x)
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
        if cfg.spread and mean_loss is not None:
            found.extend(self._spread_test(event, mean_loss, floor, {f.evidence["category"] for f in found}))
        return found

    def _spread_test(
        self, event: StepEvent, mean_loss: float, floor: float, named: set[str]
    ) -> list[Finding]:
        """The second test (module doc): a category's own level, in units of its per-sample spread, rising
        with its share of the batch's tail."""
        cfg = self.config
        found: list[Finding] = []
        spreads = self._spread
        for name, loss in event.category_loss.items():
            count, mean, sumsq, tail = loss.count, loss.mean, loss.sumsq, loss.tail_count
            if (
                sumsq is None
                or tail is None
                or count <= 0
                or not (0.0 <= mean < math.inf and 0.0 <= sumsq < math.inf)
            ):
                continue
            sp = spreads.get(name)
            if sp is None:
                sp = spreads[name] = _Spread(cfg.spread_window)
            pool = sp.pool
            pool[0] += count
            pool[1] += mean * count
            pool[2] += sumsq
            pool[3] += tail
            pool[4] += mean_loss * count
            if pool[0] < cfg.spread_count:
                continue
            n, total, squares, tails, means = pool
            sp.pool = [0.0, 0.0, 0.0, 0.0, 0.0]
            m = total / n
            sigma = math.sqrt(max(squares / n - m * m, 0.0))
            pooled_mean = means / n
            x = math.log(m + floor) - math.log(pooled_mean + floor)
            share = tails / n
            if sp.seen < cfg.spread_warmup:
                sp.learn(m, sigma, x, share, pooled_mean)
                continue
            # the category's typical level, raised with the run's mean loss where that rose (a run-wide
            # rise is not the category's; a falling run mean, the others learning, does not lower it)
            typical_run = sp.run_mean.median()
            level = sp.level.median() * max(1.0, pooled_mean / typical_run if typical_run > 0 else 1.0)
            scale = max(sp.sigma.median(), SPREAD_MIN_SIGMA * level, 1e-12) / math.sqrt(n)
            z = (m - level) / scale
            sp.last_z = z
            others = [o.last_z for k, o in spreads.items() if k != name and o.last_z is not None]
            others_z = statistics.median(others) if others else math.inf
            step_z = z - cfg.spread_allowance
            if not (x - sp.relative.median() >= self._log_spread_ratio and others_z < SPREAD_OTHERS_Z):
                step_z = min(step_z, 0.0)
            had = sp.cusum
            sp.cusum = max(0.0, had + step_z)
            if sp.cusum > 0 and had == 0:
                sp.onset_step, sp.tail_n, sp.tail_count = event.step, 0, 0
            if sp.cusum > 0:
                sp.tail_n += int(round(n))
                sp.tail_count += int(round(tails))
                typical_share = min(max(sp.tail_share.median(), SPREAD_MIN_SHARE), 1 - SPREAD_MIN_SHARE)
                tail_share = sp.tail_count / sp.tail_n
                tail_z = (tail_share - typical_share) / math.sqrt(
                    typical_share * (1 - typical_share) / sp.tail_n
                )
                cat = self._categories.get(name)
                if (
                    sp.cusum >= cfg.spread_threshold
                    and tail_z >= cfg.spread_tail_z
                    and name not in named
                    and cat is not None
                    and not cat.cooldown.active(event.step)
                ):
                    cat.cooldown.start(event.step, cfg.cooldown_steps)
                    found.append(
                        self._spread_finding(
                            event, name, sp, m, level, z, others_z, tail_share, typical_share, tail_z
                        )
                    )
            if sp.cusum <= cfg.spread_allowance:
                sp.learn(m, sigma, x, share, pooled_mean)
        return found

    def _spread_finding(
        self,
        event: StepEvent,
        name: str,
        sp: _Spread,
        loss: float,
        typical: float,
        z: float,
        others_z: float,
        tail_share: float,
        typical_share: float,
        tail_z: float,
    ) -> Finding:
        cfg = self.config
        sigma = sp.sigma.median()
        return Finding(
            detector=NAME,
            metric=f"category_loss.{name}",
            step=event.step,
            rank=event.rank,
            severity="warning",
            message=(
                f"category {name!r} loss creeping up: {loss:.4g} against its typical {typical:.4g} "
                f"({z:.1f} standard errors of its per-sample spread {sigma:.3g}; evidence since step "
                f"{sp.onset_step} adds up to {sp.cusum:.1f}), and {100 * tail_share:.0f}% of its samples are "
                f"among the batch's worst tenth against a typical {100 * typical_share:.0f}% "
                f"(z {tail_z:.1f}), "
                f"while the other categories are at a median z of {others_z:.1f}"
            ),
            value=loss,
            threshold=typical,
            score=sp.cusum,
            evidence={
                "category": name,
                "test": "spread",
                "typical_loss": typical,
                "sigma": sigma,
                "robust_z": z,
                "cusum": sp.cusum,
                "cusum_threshold": cfg.spread_threshold,
                "tail_share": tail_share,
                "typical_tail_share": typical_share,
                "tail_z": tail_z,
                "others_median_z": others_z,
                "onset_step": sp.onset_step,
            },
        )

    def _observe_mean(self, event: StepEvent) -> tuple[float | None, float | None, float]:
        """Learn the step's mean loss: ``(mean loss, its ratio to its typical level before this step, the
        loss floor)``, the first two None when unknown; the floor is a quarter of the run's typical loss,
        which offsets the losses before the log (see the module doc)."""
        mean_loss = self._mean_loss(event)
        mean_ratio = None
        history = self._mean_history
        # (median() is get(0.5) of a window that is not empty, without the lookup of its plan)
        typical_mean = history.median() if len(history) else None
        if mean_loss is not None:
            log_mean = math.log(mean_loss)
            if typical_mean is not None:
                mean_ratio = math.exp(log_mean - typical_mean)
            history.update(log_mean)
            typical_mean = history.median()
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
