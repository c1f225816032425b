"""A broken layer named from its outputs (issue 37): ``module_activations`` (``rw.watch(...,
activations=True)``, on the steps the producer samples) per module.

Dead units: a module whose fraction of exactly-zero outputs reaches ``dead_frac`` (0.9) from a learnt
level at most ``dead_level`` (0.5): ninety percent of a ReLU's units dead after a bias pushed far
negative, a bad init or an LR jump. Found at the first sampled step with it (within the producer's
``activations_every`` steps of the onset). A module zero that often from the start (sparse by design) is
never judged; one that comes back below ``dead_level`` re-arms.

Growth: a module's output RMS (the median of its last 3 samples) at least ``growth`` (1.4x) its own level
of ``lag`` samples earlier (the median of ``window`` samples ending there) for ``patience`` samples in a row:
an output compounding step by step (a residual branch without a norm, a gain parameter running away),
named long before it reaches the loss. Its level is learnt only after ``warmup`` samples (LR warm-up, the
early growth of a fresh init), so growth is judged from ``warmup + window + lag`` samples on; a module
fires once until its output falls back to its level.

Joined view: the cross-rank join gives per module the root mean square of the ranks' RMS and the largest
zero fraction (a layer dead on one rank is dead), so a run gets one finding per module.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from datetime import datetime

from pydantic import Field

from runwatch.contract.schema import StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register


class ActivationsConfig(Strict):
    """Dead units and runaway output growth of one module, from the producer's activation samples."""

    enabled: bool = True
    warmup: int = Field(default=30, ge=2, description="activation samples of a module before it is judged")
    dead_frac: float = Field(
        default=0.9, gt=0, le=1, description="fraction of exactly-zero outputs that makes a module dead"
    )
    dead_level: float = Field(
        default=0.5, ge=0, lt=1, description="the module's learnt zero fraction must be at most this"
    )
    growth: float = Field(default=1.4, gt=1, description="output RMS over its own level of lag samples ago")
    window: int = Field(default=6, ge=1, description="samples whose median is a module's level")
    lag: int = Field(default=8, ge=1, description="samples between the level and the value compared with it")
    patience: int = Field(default=2, ge=1, description="samples in a row with the RMS above growth x level")


NAME = "activations"
RECENT = 3  # samples whose median is a module's current output RMS


class _Module:
    __slots__ = ("dead", "grown", "log_rms", "rising", "samples", "zero_fracs")

    def __init__(self, keep: int) -> None:
        self.samples = 0
        self.zero_fracs: deque[float] = deque(maxlen=keep)
        self.log_rms: deque[float] = deque(maxlen=keep)
        self.rising = 0  # samples in a row whose recent RMS is above growth x level
        self.dead = False
        self.grown = False


class ActivationsDetector(Detector):
    name = NAME

    def __init__(self, config: ActivationsConfig):
        self.config = config
        self._modules: dict[str, _Module] = {}
        self._keep = config.window + config.lag

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent) or not event.module_activations:
            return []
        findings: list[Finding] = []
        for name, stats in event.module_activations.items():
            module = self._modules.get(name)
            if module is None:
                module = self._modules[name] = _Module(self._keep)
            if not (math.isfinite(stats.rms) and stats.rms > 0):
                continue  # all zeros (or non-finite): the dead check below has the former
            finding = self._dead(event, name, module, stats.zero_frac) or self._growth(
                event, name, module, math.log(stats.rms)
            )
            module.samples += 1
            if finding is not None:
                findings.append(finding)
        return findings

    def _dead(self, event: StepEvent, name: str, module: _Module, zero_frac: float) -> Finding | None:
        c = self.config
        level = statistics.median(module.zero_fracs) if module.zero_fracs else None
        if module.dead:
            if zero_frac <= c.dead_level:
                module.dead = False
            return None
        if (
            level is not None
            and module.samples >= c.warmup
            and zero_frac >= c.dead_frac
            and level <= c.dead_level
        ):
            module.dead = True
            return self._finding(
                event,
                name,
                "dead",
                f"module {name}: {zero_frac:.0%} of its outputs exactly 0 (dead units), from a level of "
                f"{level:.0%}",
                zero_frac,
                c.dead_frac,
                {"zero_frac": zero_frac, "level": level},
            )
        module.zero_fracs.append(zero_frac)
        return None

    def _growth(self, event: StepEvent, name: str, module: _Module, log_rms: float) -> Finding | None:
        c = self.config
        if module.samples < c.warmup:
            return None  # the level is learnt after the warm-up only: early growth is training's
        history = module.log_rms
        history.append(log_rms)
        if len(history) < self._keep:
            return None
        values = list(history)
        level = statistics.median(values[: c.window])
        now = statistics.median(values[-RECENT:])  # one noisy sample is not growth
        above = now - level >= math.log(c.growth)
        if module.grown:
            if not above:
                module.grown, module.rising = False, 0
            return None
        module.rising = module.rising + 1 if above else 0
        if module.rising < c.patience:
            return None
        module.grown = True
        ratio = math.exp(now - level)
        return self._finding(
            event,
            name,
            "growth",
            f"module {name}: output RMS {math.exp(now):.4g} (median of the last {RECENT} samples) is "
            f"{ratio:.2f}x its level of {c.lag} samples earlier, for {c.patience} samples in a row",
            ratio,
            c.growth,
            {"rms": math.exp(log_rms), "level_rms": math.exp(level), "ratio": ratio},
        )

    def _finding(
        self,
        event: StepEvent,
        name: str,
        kind: str,
        message: str,
        value: float,
        threshold: float,
        extra: dict[str, float],
    ) -> Finding:
        return Finding(
            detector=NAME,
            metric=f"module_activations.{name}",
            step=event.step,
            rank=event.rank,
            severity="warning",
            message=message,
            value=value,
            threshold=threshold,
            score=value / threshold,
            evidence={"module": name, "kind": kind, **extra},
        )


register(
    DetectorSpec(
        name=NAME,
        config=ActivationsConfig,
        build=lambda d: ActivationsDetector(d.activations),
        view="joined",
        knob="growth",
        summary="one module's dead units (outputs exactly 0) or runaway output growth, named",
    )
)
