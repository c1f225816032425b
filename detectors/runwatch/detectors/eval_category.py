"""One category's evaluation loss diverging from the others (``EvalEvent.per_category``): its training
labels went bad (shuffled, joined on the wrong key) or its data changed, and only the evaluation, on clean
labels, shows it; the mean barely moves when the category is one of many.

Per split and category, the category's *relative* log loss at an eval, ``log(its loss) - median(log loss of
the other categories)``, which cancels what moves every category together (the run learning, a plateau,
overfitting). Its typical level is the median of its last ``window`` relative losses, its noise the
robust spread (MAD) of their eval-to-eval changes. An eval is *suspect* when the relative loss is above
the typical one by ``min_ratio`` or more and by ``z_threshold`` noise, and its own loss is up by
``min_rise`` or more on its lowest in the window (a category that only learns slower than the others,
its loss still falling, is not diverging); ``patience`` suspect evals in a row
make one finding naming the category. Suspect evals stay out of its history; a category with fewer than
``min_count`` examples in the eval is not judged (too few to say), nor before ``min_evals`` evals.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import EvalEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import MAD_TO_SIGMA


class EvalCategoryConfig(Strict):
    """One category's evaluation loss (EvalEvent.per_category) rising against the other categories'."""

    enabled: bool = True
    min_evals: int = Field(default=5, ge=3, description="evals of a category's history before it is judged")
    window: int = Field(
        default=8, ge=3, description="evals of history for a category's typical relative loss"
    )
    min_ratio: float = Field(
        default=1.4,
        gt=1,
        description="the category's loss relative to the others, over its typical, at least",
    )
    z_threshold: float = Field(default=3.0, gt=0, description="and this many noise units above its typical")
    patience: int = Field(default=2, ge=1, description="consecutive suspect evals before a finding")
    min_rise: float = Field(
        default=1.2, ge=1, description="the category's own loss over its lowest in the window, at least"
    )
    min_count: int = Field(default=20, ge=1, description="examples of the category an eval must score")


NAME = "eval_category_divergence"
MIN_NOISE = 0.03  # log units: the floor on a category's noise, so a very smooth one is not a hair trigger


class _Cat:
    def __init__(self, window: int) -> None:
        self.history: deque[float] = deque(maxlen=window)  # relative log losses
        self.own: deque[float] = deque(maxlen=window)  # its own log losses
        self.streak = 0
        self.since: int | None = None
        self.fired = False


class EvalCategoryDetector(Detector):
    name = NAME

    def __init__(self, config: EvalCategoryConfig):
        self.config = config
        self._cats: dict[tuple[str, str], _Cat] = {}
        self._log_ratio = math.log(config.min_ratio)
        self._log_rise = math.log(config.min_rise)

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, EvalEvent) or len(event.per_category) < 3:
            return []
        cfg = self.config
        logs: dict[str, float] = {}
        for name, figures in event.per_category.items():
            loss, count = figures.get("loss"), figures.get("count")
            if loss is None or not math.isfinite(loss) or loss <= 0:
                continue
            if count is not None and count < cfg.min_count:
                continue
            logs[name] = math.log(loss)
        if len(logs) < 3:
            return []
        found: list[Finding] = []
        for name, x in logs.items():
            others = statistics.median(v for n, v in logs.items() if n != name)
            rel = x - others
            cat = self._cats.get((event.split, name))
            if cat is None:
                cat = self._cats[(event.split, name)] = _Cat(cfg.window)
            if len(cat.history) < cfg.min_evals:
                cat.history.append(rel)
                cat.own.append(x)
                continue
            typical = statistics.median(cat.history)
            noise = self._noise(cat.history)
            deviation = rel - typical
            rose = x - min(cat.own) >= self._log_rise
            if deviation < self._log_ratio or deviation < cfg.z_threshold * noise or not rose:
                cat.history.append(rel)
                cat.own.append(x)
                cat.streak, cat.since, cat.fired = 0, None, False
                continue
            if cat.streak == 0:
                cat.since = event.step
            cat.streak += 1
            if cat.streak >= cfg.patience and not cat.fired:
                cat.fired = True
                found.append(self._finding(event, name, cat, math.exp(x), math.exp(others), deviation, noise))
        return found

    @staticmethod
    def _noise(history: deque[float]) -> float:
        values = list(history)
        changes = [b - a for a, b in zip(values, values[1:], strict=False)]
        if not changes:
            return MIN_NOISE
        mid = statistics.median(changes)
        mad = statistics.median(abs(c - mid) for c in changes)
        return max(mad * MAD_TO_SIGMA, MIN_NOISE)

    def _finding(
        self,
        event: EvalEvent,
        name: str,
        cat: _Cat,
        loss: float,
        others: float,
        deviation: float,
        noise: float,
    ) -> Finding:
        ratio = math.exp(deviation)
        typical_rel = math.exp(statistics.median(cat.history))
        return Finding(
            detector=NAME,
            metric=f"eval_per_category.{event.split}.{name}",
            step=event.step,
            rank=event.rank,
            severity="warning",
            message=(
                f"category {name!r} diverges in {event.split}: its loss {loss:.4g} is {loss / others:.2f}x "
                f"the other categories' median {others:.4g}, where it was typically {typical_rel:.2f}x "
                f"({ratio:.2f}x "
                f"its usual standing, {deviation / noise:.1f} noise units) for {cat.streak} evals since step "
                f"{cat.since}: its training labels or data for that category?"
            ),
            value=loss,
            threshold=others * typical_rel * self.config.min_ratio,
            score=deviation / noise,
            evidence={
                "category": name,
                "split": event.split,
                "loss": loss,
                "others_median_loss": others,
                "ratio": ratio,
                "typical_relative_loss": typical_rel,
                "consecutive_evals": cat.streak,
                "first_suspect_step": cat.since,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=EvalCategoryConfig,
        build=lambda d: EvalCategoryDetector(d.eval_category_divergence),
        view="joined",
        knob="min_ratio",
        summary="one category's evaluation loss (per_category) diverging from the other categories'",
    )
)
