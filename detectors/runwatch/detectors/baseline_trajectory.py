"""A run in flight against its job's history at the same step: later divergence (loss above where
earlier runs were), earlier overfitting (eval loss above), slower recovery (the loss staying above
after a bump), step time or memory above, and a module whose gradient norm is far above where that
module sat in earlier runs (named).

The band (``baselines/band.py``: per metric and step, the low / middle / high quantiles of the
baseline runs) is handed in with ``set_band``; the detector does no I/O. Per metric and step the
threshold is the band's high quantile times the larger of the metric's minimum ratio and the
band's own width (high / low, to the power ``band_widths``), so the run-to-run spread of a noisy
metric widens it and a band of very similar runs is not a hair trigger. A metric above its
threshold for ``consecutive_steps`` steps in a row (evals: ``consecutive_evals``) is one finding;
it re-arms once the metric is back inside. Steps past the band's end, and metrics the band does
not have (a module the earlier runs did not report), are not judged.

Without a band it is silent. When the band could not be had, ``set_band(None, reason)`` makes it
say why once (an ``info`` finding, never an alarm); a band of fewer than ``min_runs`` runs is
treated the same way. Nothing handed at all (no baseline source configured): fully silent, and
the worker logs why.

Cost per step event: one vector of the event's values compared with one gather of precomputed
thresholds (the rows of the event's metrics are cached while its module names stay the same); the
streak bookkeeping runs only while some metric is above its threshold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from runwatch.contract.schema import EvalEvent, StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.baselines.band import EVAL_PREFIX, MEMORY_FIELDS, MODULE_PREFIX, BaselineBand
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register


class BaselineTrajectoryConfig(Strict):
    """The run against its job's earlier runs at the same step (the band is handed in by the worker)."""

    enabled: bool = True
    min_runs: int = Field(
        default=3, ge=1, description="a band of fewer baseline runs is not used (says so once)"
    )
    consecutive_steps: int = Field(
        default=10, ge=1, description="steps in a row above the band for a finding"
    )
    consecutive_evals: int = Field(default=2, ge=1, description="evals in a row above the band for a finding")
    band_widths: float = Field(
        default=1.0,
        ge=0,
        description="the threshold is at least the band's high x (high / low) to this power",
    )
    loss_ratio: float = Field(
        default=1.5, ge=1, description="loss above the band's high quantile by this factor"
    )
    grad_norm_ratio: float = Field(
        default=3.0, ge=1, description="grad norm above the band's high by this factor"
    )
    module_ratio: float = Field(
        default=5.0, ge=1, description="a module's grad norm above its band's high by this"
    )
    step_time_ratio: float = Field(
        default=1.2, ge=1, description="step time above the band's high by this factor"
    )
    memory_ratio: float = Field(default=1.15, ge=1, description="memory above the band's high by this factor")
    eval_loss_ratio: float = Field(
        default=1.25, ge=1, description="eval loss above the band's high by this factor"
    )
    # How the band is made (by whoever hands it in: the worker, runwatch evaluate), not used by the detector.
    max_runs: int = Field(
        default=20, ge=1, description="the band is made of at most this many newest baseline runs"
    )
    max_buckets: int = Field(
        default=2000, ge=10, description="steps are bucketed so that a band has at most this many per metric"
    )


NAME = "baseline_trajectory"
BAND_METRIC = "baseline_band"  # the metric of the info finding that says why there is no band
LO, MID, HI, THRESHOLD = range(4)  # columns of a metric's table
STEP_METRICS = ("loss", "grad_norm", "step_time_s", *MEMORY_FIELDS)  # a step event's fields, in vector order
_NO_MEMORY = (None, None, None)


def family(metric: str) -> str:
    """What kind of metric: loss, grad_norm, module, step_time, memory or eval."""
    if metric.startswith(MODULE_PREFIX):
        return "module"
    if metric.startswith(EVAL_PREFIX):
        return "eval"
    if metric.startswith("memory_"):
        return "memory"
    return {"step_time_s": "step_time"}.get(metric, metric)


@dataclass(frozen=True, eq=False)
class BandTable:
    """A band as the detector reads it: per metric row and step bucket, lo / mid / hi / threshold
    (NaN: no value); row ``len(names)`` is "not in the band". Never changed once built, so rewind
    snapshots refer to it instead of copying it (engine/rewind.py)."""

    shared_in_snapshots: ClassVar[bool] = True
    bucket: int
    names: list[str]
    index: dict[str, int]
    table: np.ndarray
    thr: np.ndarray  # the thresholds alone, contiguous: what every step reads
    about: dict[str, Any]  # the band's key, fingerprint, runs: for the evidence


NO_BAND = BandTable(
    bucket=1, names=[], index={}, table=np.full((1, 0, 4), np.nan), thr=np.full((1, 0), np.nan), about={}
)


class BaselineTrajectoryDetector(Detector):
    name = NAME

    def __init__(self, config: BaselineTrajectoryConfig):
        self.config = config
        self._ratios = {
            "loss": config.loss_ratio,
            "grad_norm": config.grad_norm_ratio,
            "module": config.module_ratio,
            "step_time": config.step_time_ratio,
            "memory": config.memory_ratio,
            "eval": config.eval_loss_ratio,
        }
        self._reset()

    def _reset(self) -> None:
        """No band, nothing judged."""
        self._band = NO_BAND
        self._silent_reason: str | None = None  # said once by the next event
        self._streak = np.zeros(1, dtype=np.int64)  # per metric, steps (evals) in a row above its threshold
        self._start = np.zeros(1, dtype=np.int64)  # where the current streak began
        self._fired = np.zeros(1, dtype=bool)  # the current episode has had its finding
        self._any_streak = False
        self._order: tuple[str, ...] | None = (
            None  # module names of the last step event, whose rows are cached
        )
        self._rows = np.zeros(0, dtype=np.intp)  # rows of the step fields, then of those modules

    # -- the band ------------------------------------------------------------------------------

    def set_band(self, band: BaselineBand | None, reason: str | None = None) -> None:
        """Hand in the run's baseline band; ``None`` with a ``reason``: there is none, say why once."""
        self._reset()  # a band replaces whatever was judged before
        if band is not None and band.n_runs < self.config.min_runs:
            reason = (
                f"the baseline {band.baseline_key!r} has {band.n_runs} earlier run(s) on this hardware, "
                f"fewer than min_runs {self.config.min_runs}: no comparison with history"
            )
            band = None
        if band is None:
            self._silent_reason = reason or "no baseline band: no comparison with history"
            return
        bucket_steps = band.bucket_steps
        metrics = {m: mb for m, mb in band.metrics.items() if mb.steps}
        names = list(metrics)
        buckets = max((mb.steps[-1] // bucket_steps + 1 for mb in metrics.values()), default=0)
        table = np.full((len(metrics) + 1, buckets, 4), np.nan)
        widths = self.config.band_widths
        for row, (metric, mb) in enumerate(metrics.items()):
            index = np.asarray(mb.steps, dtype=np.intp) // bucket_steps
            lo, mid, hi = (np.asarray(v, dtype=np.float64) for v in (mb.lo, mb.mid, mb.hi))
            with np.errstate(divide="ignore", invalid="ignore"):
                width = np.where((lo > 0) & (hi > 0), (hi / lo) ** widths, 1.0)
            table[row, index, LO], table[row, index, MID], table[row, index, HI] = lo, mid, hi
            table[row, index, THRESHOLD] = hi * np.maximum(self._ratios[family(metric)], width)
        self._band = BandTable(
            bucket=bucket_steps,
            names=names,
            index={m: i for i, m in enumerate(names)},
            table=table,
            thr=np.ascontiguousarray(table[:, :, THRESHOLD]),
            about={
                "baseline_key": band.baseline_key,
                "fingerprint": band.fingerprint,
                "baseline_runs": band.n_runs,
                "quantiles": list(band.quantiles),
            },
        )
        n = len(metrics) + 1
        self._streak, self._start, self._fired = (
            np.zeros(n, np.int64),
            np.zeros(n, np.int64),
            np.zeros(n, bool),
        )

    # -- per event -----------------------------------------------------------------------------

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent | EvalEvent):
            return []
        if self._silent_reason is not None:
            reason, self._silent_reason = self._silent_reason, None
            return [
                Finding(
                    detector=NAME,
                    metric=BAND_METRIC,
                    step=event.step,
                    severity="info",
                    message=reason,
                    rank=event.rank,
                    evidence={"reason": reason},
                )
            ]
        bucket = event.step // self._band.bucket
        if not self._band.names or bucket >= self._band.thr.shape[1]:
            return []  # no band, or the run is past the band's end
        if isinstance(event, EvalEvent):
            return self._eval(event, bucket)
        # One vector per step (a joined step's event is the run's, whichever rank it came from): the
        # step fields, then the module norms; None and non-finite values are not judged.
        norms = event.module_grad_norms
        names = tuple(norms)
        if names != self._order:
            self._rows_for(names)
        memory = event.memory
        values = np.array(
            [
                event.loss,
                event.grad_norm,
                event.step_time_s,
                *((memory.allocated, memory.peak, memory.host_rss) if memory is not None else _NO_MEMORY),
                *norms.values(),
            ],
            dtype=np.float64,
        )
        rows = self._rows
        threshold = self._band.thr[rows, bucket]
        with np.errstate(invalid="ignore"):
            above = values > threshold  # False where either is NaN (no value, or none in the band)
        if not self._any_streak and not above.any():
            return []  # the usual step: nothing above, no streak to end
        judged = np.isfinite(values) & (threshold == threshold)
        back = rows[judged & ~above]
        self._streak[back] = 0
        self._fired[back] = False
        positions = np.flatnonzero(above)
        up = rows[positions]
        self._streak[up] += 1
        self._start[up[self._streak[up] == 1]] = event.step
        self._any_streak = bool(self._streak.any())
        ready = (self._streak[up] >= self.config.consecutive_steps) & ~self._fired[up]
        if not ready.any():
            return []
        outside = [
            (self._band.names[int(rows[p])], float(values[p]), self._band.table[rows[p], bucket])
            for p in positions[ready]
        ]
        return self._findings(event, outside)

    def _rows_for(self, modules: tuple[str, ...]) -> None:
        missing = len(self._band.names)  # the row of "not in the band": its thresholds are NaN
        index = self._band.index
        names = (*STEP_METRICS, *(MODULE_PREFIX + m for m in modules))
        self._rows = np.fromiter((index.get(n, missing) for n in names), dtype=np.intp, count=len(names))
        self._order = modules

    def _eval(self, event: EvalEvent, bucket: int) -> list[Finding]:
        row = self._band.index.get(EVAL_PREFIX + event.split)
        value = event.loss
        if row is None or value is None or not math.isfinite(value):
            return []
        threshold = self._band.thr[row, bucket]
        if threshold != threshold:
            return []
        if value <= threshold:
            self._streak[row], self._fired[row] = 0, False
            self._any_streak = bool(self._streak.any())
            return []
        self._streak[row] += 1
        if self._streak[row] == 1:
            self._start[row] = event.step
        self._any_streak = True
        if self._streak[row] < self.config.consecutive_evals or self._fired[row]:
            return []
        return self._findings(event, [(self._band.names[row], value, self._band.table[row, bucket])])

    def _findings(
        self, event: StepEvent | EvalEvent, outside: list[tuple[str, float, np.ndarray]]
    ) -> list[Finding]:
        """One finding per metric, except modules: one naming the module with the largest departure."""
        findings = []
        modules = [o for o in outside if o[0].startswith(MODULE_PREFIX)]
        others = [o for o in outside if not o[0].startswith(MODULE_PREFIX)]
        for metric, _, _ in outside:
            self._fired[self._band.index[metric]] = True
        if modules:
            modules.sort(key=lambda o: _departure(o[1], o[2]), reverse=True)
            metric, value, row = modules[0]
            also = {m.removeprefix(MODULE_PREFIX): round(_departure(v, r), 3) for m, v, r in modules[1:]}
            findings.append(self._finding(event, metric, value, row, also))
        for metric, value, row in others:
            findings.append(self._finding(event, metric, value, row, {}))
        return findings

    def _finding(
        self, event: StepEvent | EvalEvent, metric: str, value: float, row: np.ndarray, also: dict[str, float]
    ) -> Finding:
        lo, mid, hi, threshold = (float(x) for x in row)
        kind = family(metric)
        departure = _departure(value, row)
        ratio = self._ratios[kind]
        at = self._band.index[metric]
        onset, count = int(self._start[at]), int(self._streak[at])
        unit = "evals" if kind == "eval" else "steps"
        evidence: dict[str, Any] = {
            "metric": metric,
            "family": kind,
            "band_lo": lo,
            "band_median": mid,
            "band_hi": hi,
            "ratio_to_median": departure,
            "consecutive": count,
            "onset_step": onset,
            **self._band.about,
        }
        what = metric
        if kind == "module":
            module = metric.removeprefix(MODULE_PREFIX)
            evidence["module"] = module
            what = f"module {module} gradient norm"
            if also:
                evidence["also_above"] = also
        message = (
            f"{what} {value:.4g} is {departure:.1f}x where the job's earlier runs were at step {event.step} "
            f"(median {mid:.4g}, band {lo:.4g}..{hi:.4g} of {self._band.about.get('baseline_runs')} runs), "
            f"above {threshold:.4g} for {count} {unit} in a row since step {onset}"
        )
        return Finding(
            detector=NAME,
            metric=metric,
            step=event.step,
            rank=event.rank,
            severity="critical" if value >= threshold * ratio else "warning",
            value=value,
            threshold=threshold,
            score=departure,
            message=message,
            evidence=evidence,
        )


def hand_band(detectors: Iterable[Detector], band: BaselineBand | None, reason: str | None = None) -> bool:
    """Give ``band`` (or the reason there is none) to the baseline detector among a run's
    ``detectors`` (a monitor's ``joined_detectors``); False if it is not there (disabled)."""
    handed = False
    for detector in detectors:
        if isinstance(detector, BaselineTrajectoryDetector):
            detector.set_band(band, reason)
            handed = True
    return handed


def _departure(value: float, row: np.ndarray) -> float:
    """How far above where the earlier runs sat: value / the band's median."""
    mid = float(row[MID])
    return value / mid if mid > 0 else math.inf


register(
    DetectorSpec(
        name=NAME,
        config=BaselineTrajectoryConfig,
        build=lambda d: BaselineTrajectoryDetector(d.baseline_trajectory),
        view="joined",
        faults=("bad_init",),
        summary=(
            "the run above its job's earlier runs at the same step (loss, eval loss, grad norms, a module's "
            "grad norm, step time, memory); the band is handed in by the worker"
        ),
    )
)
