"""A run's summary metrics against its job's history: robust bands, a direction per metric, a
per-metric minimum change, and verdicts that never pass missing data off as normal.

For each metric the history (the same baseline key and hardware fingerprint, in the window) gives a
median and a robust sigma (1.4826 x the median absolute deviation). The run's value is an
``OUTLIER`` when it lies beyond ``median +- band_sigmas x sigma`` on the metric's *worse* side (a
faster step time is not a regression) **and** differs from the median by at least the metric's
minimum relative change, so run-to-run noise in a very steady history never alarms. A value that is
missing, not finite or a sentinel (an MFU of -1) is ``INVALID``; fewer than ``min_runs`` valid
history values is ``insufficient_history``. Each comparison reports the history's spread (robust
sigma / median), so tolerances can come from the distributions rather than guesswork.

Goodput (``goodput_pct``, issue 39: productive step time over wall time, in percent; the sink computes it)
is judged in points rather than in sigmas: an ``OUTLIER`` when it is more than ``goodput_points`` below
the history's median, whatever the history's spread (a run that lost a tenth of its time is worse however
noisy the others were).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from runwatch.detectors.configfile import Strict
from runwatch.detectors.rolling_quantile import MAD_TO_SIGMA

Verdict = Literal["normal", "OUTLIER", "INVALID", "insufficient_history"]
Direction = Literal["lower_is_better", "higher_is_better"]


@dataclass(frozen=True)
class MetricSpec:
    """What "worse" means for one summary metric, and how large a change must be to count."""

    direction: Direction
    min_change: float  # relative to the baseline median
    minimum: float | None = 0.0  # values below it are sentinels (INVALID); None: no bound (a loss may be < 0)
    exclusive_minimum: bool = False  # MFU and throughputs must be above 0, not at it


# The run summary's metrics (issue 14), by name, and by prefix for the families (loss at step N,
# per-category final loss, anomalies per detector).
METRICS: dict[str, MetricSpec] = {
    "training_time_s": MetricSpec("lower_is_better", 0.10),
    "step_time_median_s": MetricSpec("lower_is_better", 0.05, exclusive_minimum=True),
    "step_time_p95_s": MetricSpec("lower_is_better", 0.10, exclusive_minimum=True),
    "samples_per_s": MetricSpec("higher_is_better", 0.05, exclusive_minimum=True),
    "tokens_per_s": MetricSpec("higher_is_better", 0.05, exclusive_minimum=True),
    "mfu": MetricSpec("higher_is_better", 0.05, exclusive_minimum=True),
    "data_wait_share": MetricSpec("lower_is_better", 0.25),
    "max_cuda_allocated_bytes": MetricSpec("lower_is_better", 0.03),
    "max_cuda_reserved_bytes": MetricSpec("lower_is_better", 0.03),
    "max_cuda_peak_bytes": MetricSpec("lower_is_better", 0.03),
    "max_host_rss_bytes": MetricSpec("lower_is_better", 0.05),
    "final_loss": MetricSpec("lower_is_better", 0.05, minimum=None),
    "last_eval_loss": MetricSpec("lower_is_better", 0.05, minimum=None),
    "best_eval_loss": MetricSpec("lower_is_better", 0.05, minimum=None),
    "rollbacks": MetricSpec("lower_is_better", 0.0),
}
PREFIXED: dict[str, MetricSpec] = {
    "loss_at_step_": MetricSpec("lower_is_better", 0.05, minimum=None),
    # A category's last mean loss comes from the few samples of that category in one batch: reruns of one
    # commit differ by 25% (the history corpus's silence category), so less than 30% is noise.
    "category_loss_": MetricSpec("lower_is_better", 0.30, minimum=None),
    "anomalies_": MetricSpec("lower_is_better", 0.0),
}


GOODPUT_METRIC = "goodput_pct"  # the summary's goodput, in percent (sinks/runwatch/sinks/goodput.py)


def metric_spec(name: str) -> MetricSpec | None:
    """The spec of a summary metric, or None for a name runwatch does not judge."""
    spec = METRICS.get(name)
    if spec is not None:
        return spec
    return next((s for prefix, s in PREFIXED.items() if name.startswith(prefix)), None)


class BaselineConfig(Strict):
    """How a run is compared with its job's history."""

    window_days: float = Field(
        default=30.0, gt=0, description="the history: runs that started this many days before"
    )
    min_runs: int = Field(default=5, ge=2, description="fewer valid history values is 'insufficient_history'")
    band_sigmas: float = Field(default=3.0, gt=0, description="the band's half-width in robust sigmas")
    loss_every: int = Field(
        default=100, ge=1, description="the summary's loss_at_step_N: every this many steps"
    )
    min_change: dict[str, float] = Field(
        default_factory=dict,
        description="per-metric minimum relative change that can be an outlier (overrides the built-in ones)",
    )
    goodput_points: float = Field(
        default=5.0,
        gt=0,
        le=100,
        description="goodput (productive time over wall time, %) more than this many points below the "
        "history's median is an OUTLIER",
    )


@dataclass(frozen=True)
class MetricComparison:
    """One metric of one run against its history."""

    metric: str
    value: float | None
    verdict: Verdict
    n: int  # valid history values
    median: float | None = None
    low: float | None = None  # the band
    high: float | None = None
    spread: float | None = None  # robust sigma / |median|: the run-to-run spread of this metric here
    change: float | None = None  # (value - median) / |median|
    reason: str = ""


def is_valid(value: float | None, spec: MetricSpec) -> bool:
    if value is None or isinstance(value, bool) or not math.isfinite(value):
        return False
    if spec.minimum is None:
        return True
    return value > spec.minimum if spec.exclusive_minimum else value >= spec.minimum


def compare_metric(
    metric: str,
    value: float | None,
    history: Iterable[float | None],
    spec: MetricSpec,
    config: BaselineConfig,
) -> MetricComparison:
    """``value`` against the valid values of ``history`` (invalid ones are left out of it)."""
    past = [v for v in history if v is not None and is_valid(v, spec)]
    n = len(past)
    if value is None or not is_valid(value, spec):
        return MetricComparison(metric, value, "INVALID", n, reason=_invalid_reason(value, spec))
    if n < config.min_runs:
        return _insufficient(metric, value, n, config)
    median = statistics.median(past)
    sigma = MAD_TO_SIGMA * statistics.median(abs(v - median) for v in past)
    half = config.band_sigmas * sigma
    low, high = median - half, median + half
    scale = abs(median)
    change = (
        (value - median) / scale
        if scale > 0
        else (0.0 if value == median else math.copysign(math.inf, value))
    )
    spread = sigma / scale if scale > 0 else None
    min_change = config.min_change.get(metric, spec.min_change)
    worse = value > high if spec.direction == "lower_is_better" else value < low
    worse_by = change if spec.direction == "lower_is_better" else -change
    if worse and worse_by > min_change:
        verdict: Verdict = "OUTLIER"
        reason = (
            f"{'above' if spec.direction == 'lower_is_better' else 'below'} the band by "
            f"{abs(change):.1%} of the median (at least {min_change:.0%} counts)"
        )
    else:
        verdict, reason = "normal", ""
    return MetricComparison(metric, value, verdict, n, median, low, high, spread, change, reason)


def _invalid_reason(value: float | None, spec: MetricSpec) -> str:
    if value is None:
        return "missing"
    if not math.isfinite(value):
        return "not finite"
    return (
        f"{value:g} is a sentinel (must be "
        f"{'above' if spec.exclusive_minimum else 'at least'} {spec.minimum:g})"
    )


def compare_run(
    summary: Mapping[str, float | None], history: Sequence[Mapping[str, float | None]], config: BaselineConfig
) -> list[MetricComparison]:
    """Every judged metric of a run's summary against the same metric in the history's summaries,
    in the summary's order; metrics runwatch does not judge are left out."""
    out = []
    for metric, value in summary.items():
        if metric == GOODPUT_METRIC:
            out.append(compare_goodput(value, (h.get(metric) for h in history), config))
            continue
        spec = metric_spec(metric)
        if spec is None:
            continue
        out.append(compare_metric(metric, value, (h.get(metric) for h in history), spec, config))
    return out


def compare_goodput(
    value: float | None, history: Iterable[float | None], config: BaselineConfig
) -> MetricComparison:
    """A run's goodput (%) against its history's: ``OUTLIER`` when more than ``config.goodput_points``
    below the median. The band is [median - points, 100]."""
    past = [v for v in history if v is not None and math.isfinite(v) and 0 <= v <= 100]
    n = len(past)
    metric = GOODPUT_METRIC
    if value is None or not math.isfinite(value) or not 0 <= value <= 100:
        reason = "missing" if value is None else f"{value:g} is not a percentage"
        return MetricComparison(metric, value, "INVALID", n, reason=reason)
    if n < config.min_runs:
        return _insufficient(metric, value, n, config)
    median = statistics.median(past)
    sigma = MAD_TO_SIGMA * statistics.median(abs(v - median) for v in past)
    low = median - config.goodput_points
    change = (value - median) / median if median > 0 else None
    spread = sigma / median if median > 0 else None
    if value < low:
        reason = (
            f"{median - value:.1f} points below the history's median {median:.1f}% "
            f"(more than {config.goodput_points:g} counts)"
        )
        return MetricComparison(metric, value, "OUTLIER", n, median, low, 100.0, spread, change, reason)
    return MetricComparison(metric, value, "normal", n, median, low, 100.0, spread, change)


def outliers(comparisons: Iterable[MetricComparison]) -> list[MetricComparison]:
    return [c for c in comparisons if c.verdict == "OUTLIER"]


def _insufficient(metric: str, value: float | None, n: int, config: BaselineConfig) -> MetricComparison:
    """The verdict on a metric whose history holds fewer than ``config.min_runs`` valid runs."""
    return MetricComparison(
        metric,
        value,
        "insufficient_history",
        n,
        reason=f"{n} valid run(s) in the history, {config.min_runs} needed",
    )
