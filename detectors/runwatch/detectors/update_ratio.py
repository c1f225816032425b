"""Relative update norm (|update| / |params|) leaving its healthy band: too large or vanishing.

The band is the run's own typical ratio (rolling median of log ratio: river ``RollingQuantile``'s
numbers, from ``rolling_quantile.RollingQuantiles``) times / divided by ``factor``, bounded by the
absolute ``low`` / ``high`` limits, and ``patience`` consecutive out-of-band observations make a finding.

A ratio change that the learning rate explains is planned, not a fault: for SGD and
Adam the update is proportional to the LR, so a warm-up ramp or a step decay moves the
ratio with the LR while the update per unit of LR (ratio / LR) stays in its own band.
An out-of-band observation is excused when (a) ratio / LR is in band and (b) the LR
moved like a schedule does since the last in-band observation: up by at most ``factor``
(a ramp, not a jump), down by at most ``factor``**2 (a step decay), or to zero after
having already annealed below its peak / ``factor``. A jump of the LR itself (x100) or
its collapse (x1e-6) is not excused, nor is frozen weights (ratio 0 at an unchanged LR),
nor anything above the absolute ``high``. Without LR in the events, only the band counts.

Unexcused observations stay out of the history, so a fault is not learnt as normal,
unless they last a full ``window`` (then they are the new normal).

The update norm is measured every ``update_every`` steps (10 by default: it costs a copy of the
weights), but the LR comes with every step, and for SGD and Adam the update scales with it. So every
step the detector also checks the LR against the run's schedule so far, and the finding comes at the
step the LR changed: a jump up by ``lr_jump`` or more at once to above every LR the run has had (a
warm restart goes back to a peak it had; a warm-up ramps by smaller steps), or a drop by
``lr_drop`` or more at once (a step decay divides by 10; a schedule that ends anneals to zero
slowly). Its evidence estimates the update ratio now: the last measured one times the LR's change
since (``estimated_ratio``).
"""

from __future__ import annotations

import math
from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.cooldown import Cooldown
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register
from runwatch.detectors.rolling_quantile import RollingQuantiles


class UpdateRatioConfig(Strict):
    """Relative update norm (update / parameter norm) leaving its healthy band: vanishing or too large."""

    enabled: bool = True
    warmup: int = Field(default=5, ge=1, description="observations (update-norm steps) before any finding")
    window: int = Field(default=50, ge=4, description="observations of history for the run's typical ratio")
    factor: float = Field(
        default=10.0, gt=1, description="a ratio this many times above/below typical is out of band"
    )
    low: float = Field(default=1e-6, gt=0, description="absolute floor: below it the updates have vanished")
    high: float = Field(
        default=1e-1, gt=0, description="absolute ceiling: above it the updates are too large"
    )
    patience: int = Field(
        default=3, ge=1, description="consecutive out-of-band observations before a finding"
    )
    cooldown_steps: int = Field(default=100, ge=0)
    lr_jump: float = Field(
        default=5.0,
        gt=1,
        description="an LR this many times the last step's, above every LR the run had, is a fault at once",
    )
    lr_drop: float = Field(
        default=100.0, gt=1, description="an LR divided by this much or more in one step is a fault at once"
    )


NAME = "update_ratio"
LR_RECORDS = 256  # new LR peaks remembered (a warm-up makes one per step; a decay none)


def largest_lr(event: StepEvent) -> float | None:
    """The largest finite LR over the parameter groups (the one that drives the global update norm), or
    None; ``loss_rise`` reads the LR through it too."""
    if len(event.lr) == 1:  # one parameter group (the usual case, on every step): no list to build
        lr = event.lr[0]
        return lr if math.isfinite(lr) and lr >= 0 else None
    lrs = [lr for lr in event.lr if math.isfinite(lr) and lr >= 0]
    return max(lrs) if lrs else None


class UpdateRatioDetector(Detector):
    name = NAME

    def __init__(self, config: UpdateRatioConfig):
        self.config = config
        self._log_factor = math.log(config.factor)
        self._median = RollingQuantiles(config.window)  # log ratio
        self._median_per_lr = RollingQuantiles(config.window)  # log(ratio / lr)
        self.seen = 0  # observations in the history
        self._per_lr_seen = 0
        self._lr_ref: float | None = None  # LR at the last trusted (in-band or excused) observation
        self._lr_peak = 0.0
        self._streak = 0  # consecutive unexcused out-of-band observations
        self._direction: str | None = None
        self._onset_step = 0
        self._cooldown = Cooldown()
        self._last_lr: float | None = None  # the previous step's LR
        self._measured: tuple[float, float] | None = None  # the last in-band (ratio, LR) with LR > 0

    # Class defaults: a detector pickled before the per-step LR check existed reads them.
    _last_lr: float | None = None
    _measured: tuple[float, float] | None = None
    _lr_seen = 0  # steps with an LR
    _lr_at_step: int | None = None  # the step of _last_lr
    # (step, LR) each time the LR rose above every earlier one: the peak so far, which a step counter going
    # back (a rollback the monitor had no snapshot to rewind) cuts back to the peak of the restored steps.
    _lr_records: tuple[tuple[int, float], ...] = ()

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent):
            return []
        lr_fault = self._lr_step(event)
        if lr_fault is not None:
            return [lr_fault]
        if event.relative_update_norm is None:
            return []
        return self._update_ratio(event, event.relative_update_norm)

    def _lr_step(self, event: StepEvent) -> Finding | None:
        """The per-step LR check: a finding at the step the LR jumped or collapsed against the schedule."""
        lr = largest_lr(event)
        if lr is None:
            return None
        if self._lr_at_step is not None and event.step <= self._lr_at_step:
            # the run went back (a rollback): compare with the restored steps, not the ones it left
            self._lr_records = tuple(r for r in self._lr_records if r[0] < event.step)
            self._last_lr = None
        before = self._last_lr
        peak = self._lr_records[-1][1] if self._lr_records else 0.0
        self._last_lr, self._lr_at_step = lr, event.step
        if lr > peak:
            self._lr_records = (*self._lr_records, (event.step, lr))[-LR_RECORDS:]
        self._lr_seen += 1
        if before is None or before <= 0 or self._lr_seen <= self.config.warmup:
            return None  # no schedule to judge against yet (a warm-up from zero starts here)
        change = lr / before
        if change >= self.config.lr_jump and lr > peak * (1 + 1e-6):
            direction = "too_large"
        elif change <= 1 / self.config.lr_drop and not (lr == 0 and before * self.config.factor <= peak):
            direction = "vanishing"  # (an annealing schedule that ends at zero is not a collapse)
        else:
            return None
        if self._cooldown.active(event.step):
            return None
        self._cooldown.start(event.step, self.config.cooldown_steps)
        return self._lr_finding(event, direction, lr, before, peak)

    def _update_ratio(self, event: StepEvent, ratio: float) -> list[Finding]:
        if not math.isfinite(ratio) or ratio < 0:
            return []  # non-finite updates are the non-finite detector's
        lr = largest_lr(event)
        x = math.log(ratio) if ratio > 0 else -math.inf
        if self.seen < self.config.warmup:
            self._trust(x, lr)
            return []

        cfg = self.config
        typical = self._median.get(0.5)
        assert typical is not None  # past warm-up
        too_large = x > typical + self._log_factor or ratio > cfg.high
        vanishing = x < typical - self._log_factor or ratio < cfg.low
        if not (too_large or vanishing):
            self._trust(x, lr)
            return []
        direction = "too_large" if too_large else "vanishing"
        if self._explained(direction, ratio, x, lr):
            self._trust(x, lr)
            return []

        if direction != self._direction or self._streak == 0:
            self._streak = 0
            self._direction = direction
            self._onset_step = event.step
        self._streak += 1
        if self._streak >= cfg.window:  # it has lasted a full window: this is the run's new normal
            self._trust(x, lr)
        if self._streak < cfg.patience or self._cooldown.active(event.step):
            return []
        self._cooldown.start(event.step, cfg.cooldown_steps)
        return [self._finding(event, ratio, typical, lr)]

    def _trust(self, x: float, lr: float | None) -> None:
        self._streak = 0
        self._direction = None
        if lr is not None:
            self._lr_ref = lr
            self._lr_peak = max(self._lr_peak, lr)
        if not math.isfinite(x):
            return  # a zero update (LR 0 at the start of a warm-up) has no log
        if lr:
            self._measured = (math.exp(x), lr)
        self._median.update(x)
        self.seen += 1
        if lr:
            self._median_per_lr.update(x - math.log(lr))
            self._per_lr_seen += 1

    def _explained(self, direction: str, ratio: float, x: float, lr: float | None) -> bool:
        """Whether the LR schedule accounts for this out-of-band ratio (see the module docstring)."""
        cfg = self.config
        if ratio > cfg.high or lr is None or self._lr_ref is None or self._per_lr_seen == 0:
            return False
        if lr == 0:
            # Zero LR, zero update: planned only at the end of an annealing schedule, not a sudden drop.
            return ratio == 0 and self._lr_ref * cfg.factor <= self._lr_peak
        if self._lr_ref == 0 or ratio == 0:
            return False
        per_lr = x - math.log(lr)
        per_lr_typical = self._median_per_lr.get(0.5)
        assert per_lr_typical is not None  # (_per_lr_seen > 0)
        if abs(per_lr - per_lr_typical) > self._log_factor:
            return False  # the optimizer did not do what the LR asked
        change = lr / self._lr_ref
        if direction == "too_large":
            return change <= cfg.factor
        return change >= 1 / cfg.factor**2

    def _finding(self, event: StepEvent, ratio: float, typical_log: float, lr: float | None) -> Finding:
        cfg = self.config
        typical = math.exp(typical_log)
        band_low = max(typical / cfg.factor, cfg.low)
        band_high = min(typical * cfg.factor, cfg.high)
        too_large = self._direction == "too_large"
        times = ratio / typical if too_large else (typical / ratio if ratio > 0 else math.inf)
        lr_note = ""
        if lr is not None and self._lr_ref is not None:
            lr_note = f"; LR {lr:.3g}, was {self._lr_ref:.3g} when last in band"
        what = "too large" if too_large else "vanishing"
        amount = f"{times:.3g}x {'above' if too_large else 'below'}" if ratio > 0 else "far below"
        evidence = {
            "direction": self._direction,
            "kind": self._direction,  # what evaluation labels call it
            "typical": typical,
            "band_low": band_low,
            "band_high": band_high,
            "consecutive": self._streak,
            "lr": lr,
            "lr_before": self._lr_ref,
        }
        if self._onset_step < event.step:
            evidence["onset_step"] = self._onset_step
        return Finding(
            detector=NAME,
            metric="relative_update_norm",
            step=event.step,
            rank=event.rank,
            severity="critical" if ratio > cfg.high else "warning",
            value=ratio,
            threshold=band_high if too_large else band_low,
            score=times if math.isfinite(times) else None,
            message=(
                f"updates {what}: relative update norm {ratio:.3g} is {amount} the run's typical "
                f"{typical:.3g} (band {band_low:.3g}..{band_high:.3g}) for {self._streak} observations since "
                f"step {self._onset_step}{lr_note}"
            ),
            evidence=evidence,
        )

    def _lr_finding(self, event: StepEvent, direction: str, lr: float, before: float, peak: float) -> Finding:
        cfg = self.config
        typical_log = self._median.get(0.5)
        typical = math.exp(typical_log) if typical_log is not None else None
        estimated = self._measured[0] * lr / self._measured[1] if self._measured is not None else None
        too_large = direction == "too_large"
        change = lr / before
        times = change if too_large else before / lr if lr > 0 else math.inf
        what = (
            f"the LR jumped {times:.3g}x in one step ({before:.3g} -> {lr:.3g}), above every LR of the run "
            f"(peak {peak:.3g})"
            if too_large
            else f"the LR dropped {times:.3g}x in one step ({before:.3g} -> {lr:.3g})"
        )
        if estimated is not None and typical is not None:
            what += f": updates now about {estimated:.3g} of the weights per step (typical {typical:.3g})"
        return Finding(
            detector=NAME,
            metric="lr",
            step=event.step,
            rank=event.rank,
            severity="critical" if estimated is not None and estimated > cfg.high else "warning",
            value=lr,
            threshold=before * (cfg.lr_jump if too_large else 1 / cfg.lr_drop),
            score=times if math.isfinite(times) else None,
            message=f"updates {'too large' if too_large else 'vanishing'}: {what}; not a change the "
            "schedule so far explains",
            evidence={
                "direction": direction,
                "kind": direction,  # what evaluation labels call it
                "cause": "lr_change",
                "lr": lr,
                "lr_before": before,
                "lr_peak": peak,
                "change": change,
                "estimated_ratio": estimated,
                "typical": typical,
                "onset_step": event.step,
            },
        )


register(
    DetectorSpec(
        name=NAME,
        config=UpdateRatioConfig,
        build=lambda d: UpdateRatioDetector(d.update_ratio),
        view="joined",
        knob="factor",
        summary="the relative update norm (update / parameter norm) leaving its band: vanishing or too large",
    )
)
