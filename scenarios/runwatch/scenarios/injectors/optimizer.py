"""Faults of the optimizer and its schedule: updates too large, an LR ramp, a weight-decay jump, a swapped
optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from runwatch.scenarios.injectors.base import FaultInjector


@dataclass
class UpdateRatio(FaultInjector):
    """From the onset the LR is ``lr_scale`` times the schedule's (a resumed scheduler's bad state)."""

    kind: ClassVar[str] = "update_ratio"
    lr_scale: float

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "kind": "too_large" if self.lr_scale > 1 else "vanishing",
            "magnitude": self.lr_scale,
        }

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.active(step):
            for g in optimizer.param_groups:
                g["lr"] = self.run.base_lr(step) * self.lr_scale


@dataclass
class LrRamp(FaultInjector):
    """From the onset the LR is the schedule's times ``factor_per_step`` to the power of the steps since
    (a scheduler left multiplying, an LR range test left on: x1.01 per step is x2.7 after 100 steps), up
    to ``cap`` times: no single step jumps, the training loss rises slowly."""

    kind: ClassVar[str] = "loss_rise"
    factor_per_step: float = 1.01
    cap: float = 1e4

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "magnitude": self.factor_per_step}

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.active(step):
            assert self.run.onset is not None  # active() says so
            scale = min(self.cap, self.factor_per_step ** (step - self.run.onset + 1))
            for g in optimizer.param_groups:
                g["lr"] = self.run.base_lr(step) * scale


@dataclass
class WeightDecayJump(FaultInjector):
    """From the onset AdamW's weight decay is ``factor`` times the configured one (a config read in the
    wrong units, a resumed optimizer state with another run's decay): the weights shrink step by step,
    the loss rises slowly, no single step looks wrong."""

    kind: ClassVar[str] = "param_norm_drift"
    factor: float

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "kind": "falling" if self.factor > 1 else "rising",
            "magnitude": self.factor,
        }

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.at_onset(step):
            for g in optimizer.param_groups:
                g["weight_decay"] = g["weight_decay"] * self.factor


@dataclass
class OptimizerSwap(FaultInjector):
    """At the onset the loop replaces its AdamW with a new one (same hyperparameters, the LR of the moment,
    fresh state: a "reset the optimizer" step of a fine-tuning script) without calling ``rw.watch`` again.
    Training goes on, unwatched: the watcher's hooks are on the old optimizer, whose LR the scheduler still
    moves and the step events still report."""

    kind: ClassVar[str] = "optimizer_swap"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": "optimizer_swap"}

    def optimizer(self, step: int, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self.at_onset(step):
            return optimizer
        group = optimizer.param_groups[0]
        return torch.optim.AdamW(
            self.run.model.parameters(), lr=float(group["lr"]), weight_decay=float(group["weight_decay"])
        )
