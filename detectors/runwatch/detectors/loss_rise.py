"""The training loss rising slowly: no step jumps, yet over a few hundred steps it climbs well above the
best level the run had reached (an LR that creeps up every step, updates that grow, issue 27).

The loss is read in blocks of ``block_steps`` steps; a block's point is the median of its log losses, so a
spike moves it little. Over the last ``window_blocks`` points the robust (Theil-Sen) slope gives the trend
and the level at the window's end. The run's best level is the lowest mean of ``level_blocks``
consecutive points it kept. The run's own noise is the sigma of one point: the larger of the robust
scatter of the points' second differences (they cancel a steady trend, so neither the falling loss of
early training nor the rise itself inflates it) and the robust scatter of the steps within the blocks. A
finding needs the trend up and the level above the best by ``min_ratio`` times and by ``z_threshold``
sigmas, plus the sqrt(2 ln n) sigmas by which the lowest of n noisy levels is itself low (as
``generalization`` does for the best eval). While the LR is ``cause_ratio`` times past every LR the run
had run at before the rise, ``z_threshold`` counts ``lr_evidence`` times: no schedule of the run put the
LR there, and that is evidence too.

The schedule is taken into account: a rise around which the LR went up to no more than an LR the run had
already run at (a warm restart, a re-warm-up, a planned raise back to the peak), or that comes while the
run is still in its first warm-up (an LR that has risen at every step since the first), is the
schedule's, not a fault. Where the telemetry shows it, the finding names the likely cause: an LR that
rose with the loss, or a relative update norm that grew more than the LR did. One finding per episode:
it re-arms once the level is back near its best.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise

from pydantic import Field, model_validator

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import MAD_TO_SIGMA
from runwatch.detectors.update_ratio import largest_lr


class LossRiseConfig(Strict):
    """The training loss trending up, well above its best level, beyond the run's own noise."""

    enabled: bool = True
    block_steps: int = Field(
        default=10, ge=2, description="steps per point of the trend: the median log loss of a block"
    )
    window_blocks: int = Field(
        default=6, ge=3, description="points in the trend window: the robust slope and the level at its end"
    )
    level_blocks: int = Field(
        default=3, ge=1, description="consecutive points whose mean is one level (the best is the lowest)"
    )
    warmup_blocks: int = Field(default=10, ge=3, description="points seen before any finding")
    min_ratio: float = Field(
        default=1.3, gt=1.0, description="the level at the window's end over the best level: at least this"
    )
    z_threshold: float = Field(
        default=4.0, gt=0, description="the rise above the best level in sigmas of the run's own noise"
    )
    noise_blocks: int = Field(
        default=50, ge=4, description="the latest points whose scatter gives the run's own noise"
    )
    history_blocks: int = Field(
        default=300, ge=10, description="points kept: the best level is the lowest over them"
    )
    lr_evidence: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="z_threshold is multiplied by this while the LR is cause_ratio times past every LR the "
        "run had run at before the rise (an LR no schedule of the run planned is evidence of its own)",
    )
    cause_ratio: float = Field(
        default=1.5,
        gt=1.0,
        description="the LR or the relative update norm grown this much across the rise: named as the cause",
    )

    @model_validator(mode="after")
    def _windows_fit(self) -> LossRiseConfig:
        if max(self.window_blocks + self.level_blocks, self.noise_blocks) > self.history_blocks:
            raise ValueError("window_blocks + level_blocks, and noise_blocks, must not exceed history_blocks")
        return self


NAME = "loss_rise"


@dataclass(frozen=True, slots=True)
class _Point:
    """One block of steps: its median log loss and last step; its largest LR, and the largest the run had
    up to it; its median update ratio; the sigma of its median from the spread of its steps."""

    log_loss: float
    step: int
    lr: float | None
    lr_peak: float
    update_ratio: float | None
    spread: float


def _median_sigma(values: list[float]) -> float:
    """Sigma of the median of ``values``, from their robust spread (the median of n normal values has
    sigma sqrt(pi / 2n) times theirs)."""
    centre = statistics.median(values)
    spread = MAD_TO_SIGMA * statistics.median(abs(v - centre) for v in values)
    return spread * math.sqrt(math.pi / (2 * len(values)))


def theil_sen(ys: list[float]) -> tuple[float, float]:
    """Slope (per point) and the level at the last point of the robust line through ``ys`` at 0, 1, ...:
    the median of the pairwise slopes, then the median of the points moved along it to the end."""
    n = len(ys)
    slope = statistics.median((ys[j] - ys[i]) / (j - i) for i in range(n) for j in range(i + 1, n))
    return slope, statistics.median(y + slope * (n - 1 - i) for i, y in enumerate(ys))


class LossRiseDetector(Detector):
    """The training loss rising slowly over a window, well above the run's best level."""

    name = NAME
    # The lowest level and its index in ``_levels``, kept as points come and go (None: to be found again).
    # A class default, so a detector pickled before it existed finds it on first use.
    _best_level: tuple[float, int] | None = None

    def __init__(self, config: LossRiseConfig):
        self.config = config
        self._block: list[float] = []  # log losses of the block being filled
        self._block_ratios: list[float] = []
        self._block_lr: float | None = None
        self._points: list[_Point] = []  # the last ``history_blocks``
        # each point's level, the mean of the last ``level_blocks`` points (inf while there are fewer)
        self._levels: list[float] = []
        self._last_step = -1
        self._last_lr: float | None = None
        self._warming_up = True  # the LR has risen at every step since the first
        self._warmup_peak = 0.0  # the LR the first warm-up reached (a planned peak)
        self._fired = False  # this episode's finding is out

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent):
            return []
        if event.step == self._last_step:
            return []  # the same step again (delivered twice)
        if event.step < self._last_step:
            self._rewind(event.step)
        self._last_step = event.step
        lr = largest_lr(event)
        self._follow_lr(lr)
        loss = event.loss
        if loss is None or not math.isfinite(loss) or loss <= 0:
            return []  # non-finite losses are the non-finite detector's
        self._add(math.log(loss), lr, event.relative_update_norm)
        if len(self._block) < self.config.block_steps:
            return []
        self._close_block(event.step)
        finding = self._judge(event)
        return [finding] if finding is not None else []

    # -- the points

    def _rewind(self, step: int) -> None:
        """Replayed from an earlier step (a rollback): forget the points from there on."""
        while self._points and self._points[-1].step >= step:
            self._points.pop()
            self._levels.pop()
            if self._best_level is not None and self._best_level[1] >= len(self._levels):
                self._best_level = None  # the best was replayed away
        self._block, self._block_ratios, self._block_lr = [], [], None
        self._fired = False

    def _follow_lr(self, lr: float | None) -> None:
        if lr is None:
            self._warming_up = False  # without an LR nothing is the schedule's
            return
        if self._last_lr is not None and lr <= self._last_lr:
            self._warming_up = False
        if self._warming_up:
            self._warmup_peak = lr
        self._last_lr = lr

    def _add(self, log_loss: float, lr: float | None, ratio: float | None) -> None:
        self._block.append(log_loss)
        if lr is not None:
            self._block_lr = lr if self._block_lr is None else max(self._block_lr, lr)
        if ratio is not None and math.isfinite(ratio) and ratio > 0:
            self._block_ratios.append(ratio)

    def _close_block(self, step: int) -> None:
        points, k = self._points, self.config.level_blocks
        log_loss = statistics.median(self._block)
        ratio = statistics.median(self._block_ratios) if self._block_ratios else None
        lr_peak = max(points[-1].lr_peak if points else 0.0, self._block_lr or 0.0)
        level = statistics.fmean([p.log_loss for p in points[len(points) - k + 1 :]] + [log_loss])
        self._levels.append(level if len(points) >= k - 1 else math.inf)
        best = self._best_level
        if best is not None and self._levels[-1] < best[0]:  # (strictly: the earliest lowest stays the best)
            self._best_level = (self._levels[-1], len(self._levels) - 1)
        points.append(_Point(log_loss, step, self._block_lr, lr_peak, ratio, _median_sigma(self._block)))
        if len(points) > self.config.history_blocks:
            del points[0], self._levels[0]
            if self._best_level is not None:
                value, index = self._best_level
                self._best_level = (value, index - 1) if index > 0 else None  # the best left the history
        self._block, self._block_ratios, self._block_lr = [], [], None

    # -- the judgement

    def _noise(self) -> float:
        """Sigma of one point, over the last ``noise_blocks``: the larger of what the points' own scatter
        says (x[k] - 2 x[k-1] + x[k-2] of independent noise has variance 6 sigma²: a steady trend cancels)
        and what the scatter of the steps within the blocks says (many more values, so a steadier figure,
        but blind to slow swings)."""
        recent = self._points[-self.config.noise_blocks :]
        xs = [p.log_loss for p in self._points[-self.config.noise_blocks - 2 :]]
        diffs = [abs(xs[i] - 2 * xs[i - 1] + xs[i - 2]) for i in range(2, len(xs))]
        between = MAD_TO_SIGMA * statistics.median(diffs) / math.sqrt(6) if diffs else math.inf
        return max(between, statistics.median(p.spread for p in recent))

    def _best(self) -> tuple[float, int]:
        """The lowest level and the index of its point (the last of those it is the mean of)."""
        if self._best_level is None:  # (a scan of the whole history: only when the best left it)
            best = min(self._levels)
            self._best_level = (best, self._levels.index(best))
        return self._best_level

    def _margin(self, sigma: float, at: int) -> float:
        """How far (log units) above the best level (at point ``at``) the level must be: ``z_threshold``
        sigmas (times ``lr_evidence`` where the LR has gone past every LR the run had run at: that is
        evidence too), plus the lowest of n noisy levels being itself about sqrt(2 ln n) of their sigmas
        low."""
        cfg = self.config
        k = cfg.level_blocks
        levels = max(2.0, (len(self._points) - k + 1) / k)  # independent levels in the history
        z = cfg.z_threshold * (cfg.lr_evidence if self._lr_past_known(at) else 1.0)
        return z * sigma + math.sqrt(2 * math.log(levels)) * sigma / math.sqrt(k)

    def _rise_start(self, at: int) -> int:
        """Where a rise from the best level at point ``at`` is looked at from: a trend window before it."""
        return max(0, at - self.config.window_blocks)

    def _known_lr(self, start: int) -> float:
        """The highest LR the run had run at before point ``start``, or as its first warm-up's peak."""
        before = self._points[start - 1].lr_peak if start > 0 else 0.0
        return max(before, self._warmup_peak)

    def _lr_past_known(self, at: int) -> bool:
        """Whether the LR now is ``cause_ratio`` times the highest the run had run at before a rise from
        point ``at``."""
        now = self._points[-1].lr
        known = self._known_lr(self._rise_start(at))
        return now is not None and known > 0 and now >= self.config.cause_ratio * known

    def _judge(self, event: StepEvent) -> Finding | None:
        cfg = self.config
        points = self._points
        if len(points) < max(cfg.warmup_blocks, cfg.window_blocks + cfg.level_blocks):
            return None
        slope, level = theil_sen([p.log_loss for p in points[-cfg.window_blocks :]])
        if slope <= 0 and not self._fired:
            return None  # not rising (most blocks of a healthy run): the costlier figures are not needed
        best, at = self._best()
        if self._fired:
            if level - best < 0.5 * math.log(cfg.min_ratio):
                self._fired = False  # back near its best: the episode is over
            return None
        if level - best < math.log(cfg.min_ratio):
            return None  # under the least margin there is, whatever the noise (which costs the most)
        sigma = self._noise()
        margin = max(math.log(cfg.min_ratio), self._margin(sigma, at))
        rise = _Rise(best, level, slope, sigma, margin, points[at:])
        if rise.log_ratio < rise.margin:
            return None
        if self._planned(at):
            return None
        self._fired = True
        return self._finding(event, rise)

    def _planned(self, at: int) -> bool:
        """Whether the schedule accounts for a rise from the best level at point ``at``: the LR went up
        around the rise (from a trend window before the best level on) to no more than an LR the run had
        already run at before (a warm restart, a re-warm-up, a planned raise back to the peak) or the
        first warm-up's peak (which, while the run is still warming up, is the LR of the moment)."""
        start = self._rise_start(at)
        lrs = [p.lr for p in self._points[start:] if p.lr is not None]
        if len(lrs) < len(self._points) - start or not any(b > a for a, b in pairwise(lrs)):
            return False  # no LR, or it did not go up: not the schedule
        return max(lrs) <= self._known_lr(start)

    def _finding(self, event: StepEvent, rise: _Rise) -> Finding:
        cfg = self.config
        ratio = math.exp(rise.log_ratio)
        z = rise.log_ratio / rise.sigma if rise.sigma > 0 else math.inf
        onset = rise.onset
        per_step = math.exp(rise.slope / cfg.block_steps) - 1
        known_lr = self._known_lr(self._rise_start(len(self._points) - len(rise.since)))
        cause, cause_note, cause_evidence = _cause(rise, known_lr, cfg.cause_ratio)
        level, best = math.exp(rise.level), math.exp(rise.best)
        noise = (
            f"{z:.1f} sigmas of the run's own noise" if math.isfinite(z) else "the run's loss had no noise"
        )
        return Finding(
            detector=NAME,
            metric="loss",
            step=event.step,
            rank=event.rank,
            severity="warning",
            value=level,
            threshold=best * math.exp(rise.margin),
            score=z if math.isfinite(z) else None,
            message=(
                f"training loss rising for {event.step - onset.step} steps: its level is {level:.4g}, "
                f"{ratio:.2f}x the best level {best:.4g} it had at step {onset.step} ({noise}), and still "
                f"climbing ({per_step:+.2%} per step over the last {cfg.window_blocks * cfg.block_steps} "
                f"steps); {cause_note}"
            ),
            evidence={
                "kind": "rise",
                "onset_step": onset.step,
                "best_level": best,
                "level": level,
                "ratio": ratio,
                "slope_per_step": per_step,
                "noise_sigma_log": rise.sigma,
                "cause": cause,
                **cause_evidence,
            },
        )


@dataclass(frozen=True)
class _Rise:
    """What one judgement measured (log units): the best level, the level at the window's end, the
    trend's slope per point, the noise of one point, how far above the best the level must be, and the
    points since the best level."""

    best: float
    level: float
    slope: float
    sigma: float
    margin: float
    since: list[_Point]

    @property
    def log_ratio(self) -> float:
        return self.level - self.best

    @property
    def onset(self) -> _Point:
        return self.since[0]


def _cause(rise: _Rise, known_lr: float, cause_ratio: float) -> tuple[str | None, str, dict[str, object]]:
    """The likely cause the telemetry shows (the LR, the update size): its name, a note for the message,
    the evidence. ``known_lr``: the highest LR the run had run at before the rise."""
    onset, now = rise.onset, rise.since[-1]
    evidence: dict[str, object] = {"lr_before": onset.lr, "lr_now": now.lr, "lr_highest_before": known_lr}
    lr_grown = now.lr / onset.lr if onset.lr and now.lr else None
    if lr_grown is not None and lr_grown >= cause_ratio:
        assert now.lr is not None and onset.lr is not None  # (lr_grown)
        note = f"likely cause: the LR rose with it, {lr_grown:.3g}x ({onset.lr:.3g} -> {now.lr:.3g})"
        if known_lr > 0 and now.lr >= cause_ratio * known_lr:
            note += f", {now.lr / known_lr:.3g}x the highest LR the run had run at before ({known_lr:.3g})"
        return "lr_rise", note, evidence
    ratios = [p.update_ratio for p in rise.since[-3:] if p.update_ratio is not None]
    if onset.update_ratio and ratios:
        ratio_now = statistics.median(ratios)
        evidence |= {"update_ratio_before": onset.update_ratio, "update_ratio_now": ratio_now}
        grown = ratio_now / onset.update_ratio
        if grown >= cause_ratio:
            lr_note = f", the LR {lr_grown:.3g}x" if lr_grown is not None else ""
            note = (
                f"likely cause: the updates grew {grown:.3g}x relative to the weights (relative update norm "
                f"{onset.update_ratio:.3g} -> {ratio_now:.3g}{lr_note})"
            )
            return "update_growth", note, evidence
    return None, "neither the LR nor the update size grew with it (the data? the optimizer state?)", evidence


register(
    DetectorSpec(
        name=NAME,
        config=LossRiseConfig,
        build=lambda d: LossRiseDetector(d.loss_rise),
        view="joined",
        knob="z_threshold",
        summary="the training loss rising slowly above its best level (an LR creeping up, growing updates)",
    )
)
