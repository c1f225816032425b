"""Faults of the loss and the gradients: a non-finite value, a loss or gradient-norm spike, one module's
gradients exploding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch
from torch import nn

from runwatch.scenarios.injectors.base import FaultInjector, FaultRun
from runwatch.scenarios.tasks import Batch, Task, TinyTransformer


@dataclass
class NonFinite(FaultInjector):
    """At the onset the loss (``where="loss"``: a ``log(0)`` term, NaN loss and NaN gradients), the
    embeddings (``where="embeddings"``: scaled by ``magnitude * 1e3`` to overflow) or a weight
    (``where="weights"``: a corrupt update that no gradient shows, which the step guard cannot skip)
    become non-finite."""

    kind: ClassVar[str] = "non_finite"
    where: Literal["loss", "embeddings", "weights"]
    magnitude: float

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "magnitude": self.magnitude}

    def forward(self, model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        if self.where == "weights" and self.at_onset(step):
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = self.magnitude
        if self.where != "embeddings" or not self.at_onset(step):
            return cast(torch.Tensor, model(x))
        tt = cast(TinyTransformer, model)  # the embeddings are a TinyTransformer's
        n = x.shape[1]
        h = (tt.embed(x) + tt.pos(torch.arange(n))) * self.magnitude * 1e3
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        return cast(torch.Tensor, tt.head(tt.norm(tt.encoder(h, src_mask=mask, is_causal=True))))

    def loss(self, loss: torch.Tensor, logits: torch.Tensor, step: int) -> torch.Tensor:
        if self.where != "loss" or not self.at_onset(step):
            return loss
        return loss + 0.0 * torch.log(logits.abs().min() * 0.0)  # log(0) * 0: NaN, and NaN gradients


@dataclass
class LossSpike(FaultInjector):
    """One corrupted batch at the onset: labels shifted by ``label_shift`` classes, and with
    ``image_scale`` the inputs inverted and scaled by it."""

    kind: ClassVar[str] = "loss_spike"
    label_shift: int
    image_scale: float | None = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "magnitude": self.image_scale or float(self.label_shift)}

    def corrupt(self, task: Task | None, batch: Batch, step: int) -> Batch:
        if not self.at_onset(step):
            return batch
        assert task is not None
        y = (batch.y + self.label_shift) % task.classes
        if self.image_scale is not None:
            return Batch(-self.image_scale * batch.x, y, batch.cat)
        return Batch(batch.x, y, batch.cat)


@dataclass
class GradNormSpike(FaultInjector):
    """One step whose gradient is ``magnitude`` times too large: back-propagating the loss summed over the
    samples (``how="sample_sum"``) or over every element (``"element_sum"``), or a batch whose inputs are
    ``magnitude`` times out of range (``"scaled_inputs"``)."""

    kind: ClassVar[str] = "grad_norm_spike"
    how: Literal["sample_sum", "element_sum", "scaled_inputs"]
    magnitude: float

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "magnitude": self.magnitude}

    def corrupt(self, task: Task | None, batch: Batch, step: int) -> Batch:
        if self.how != "scaled_inputs" or not self.at_onset(step):
            return batch
        return Batch(batch.x * self.magnitude, batch.y, batch.cat, batch.tokens)

    def backward_loss(
        self, loss: torch.Tensor, per_sample: torch.Tensor, batch: Batch, step: int
    ) -> torch.Tensor:
        if not self.at_onset(step):
            return loss
        if self.how == "sample_sum":
            return per_sample.sum()
        if self.how == "element_sum":
            return loss * (batch.x.numel())
        return loss


@dataclass
class ModuleGradExplosion(FaultInjector):
    """From the onset the gradient of ``module`` grows by ``growth`` per step (a hook multiplying it), up to
    ``cap``. ``growth=None``: nothing is injected, the model is built with the fault (a bad init, present
    from step 0)."""

    kind: ClassVar[str] = "module_grad_explosion"
    module: str
    growth: float | None = None
    cap: float = 1e4

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "module": self.module,
            "kind": "bad_init" if self.growth is None else None,
            "magnitude": self.growth,
        }

    def start(self, run: FaultRun) -> None:
        super().start(run)
        self.multiplier = 1.0
        if self.growth is None:
            return
        target = dict(run.model.named_modules())[self.module]
        for p in target.parameters(recurse=False):
            p.register_hook(lambda g: g * self.multiplier)

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.growth is not None and self.active(step):
            assert self.run.onset is not None  # active() says so
            self.multiplier = min(self.cap, self.growth ** (step - self.run.onset + 1))
