"""Faults of the data and of generalisation: one category diverging, shuffled labels, validation data
leaking into training, overfitting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from runwatch.scenarios.injectors.base import FaultInjector
from runwatch.scenarios.tasks import Batch, Task


@dataclass
class CategoryDivergence(FaultInjector):
    """From the onset a share of ``category``'s samples, growing to ``share`` over ``ramp_steps``, carry
    wrong labels (a fixed permutation of the classes)."""

    kind: ClassVar[str] = "category_divergence"
    category: str
    share: float
    ramp_steps: int = 100

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "category": self.category, "magnitude": self.share}

    def corrupt(self, task: Task | None, batch: Batch, step: int) -> Batch:
        if not self.active(step):
            return batch
        assert task is not None and self.run.onset is not None  # active() says so
        hit = batch.cat == task.names.index(self.category)
        ramp = min(1.0, (step - self.run.onset + 1) / self.ramp_steps)
        g = torch.Generator().manual_seed(step)
        hit &= torch.rand(hit.shape, generator=g) < self.share * ramp
        wrong = (3 * batch.y + 1) % task.classes  # a fixed permutation of the classes with no fixed point
        return Batch(batch.x, torch.where(hit, wrong, batch.y), batch.cat)


@dataclass
class CategoryLabelShuffle(FaultInjector):
    """From the onset the training labels of ``category`` are shuffled (uniformly random classes: a join on
    the wrong key for that source); the evaluation, on clean labels, sees that category's loss rise."""

    kind: ClassVar[str] = "eval_category_divergence"
    category: str

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "category": self.category}

    def corrupt(self, task: Task | None, batch: Batch, step: int) -> Batch:
        if not self.active(step):
            return batch
        assert task is not None
        hit = batch.cat == task.names.index(self.category)
        g = torch.Generator().manual_seed(step * 13 + 5)
        shuffled = torch.randint(0, task.classes, batch.y.shape, generator=g)
        return Batch(batch.x, torch.where(hit, shuffled, batch.y), batch.cat, batch.tokens)


@dataclass
class ValidationLeak(FaultInjector):
    """From the onset a ``share`` of every training batch is drawn from the validation set (``val_size``
    examples, the one the evals score): the model learns the validation examples and the validation loss
    comes out better than it should, closing the gap to the training loss."""

    kind: ClassVar[str] = "val_train_gap"
    share: float = 0.5
    val_size: int = 256
    split: str = "val"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": "leak", "magnitude": self.share}

    def label_fields(self) -> dict[str, Any]:
        return {**super().label_fields(), "split": self.split}

    def corrupt(self, task: Task | None, batch: Batch, step: int) -> Batch:
        if not self.active(step):
            return batch
        assert task is not None
        if not hasattr(self, "_val"):
            self._val = task.validation(self.val_size)
        n = batch.x.shape[0]
        k = int(round(self.share * n))
        g = torch.Generator().manual_seed(step * 17 + 3)
        idx = torch.randint(0, self._val.x.shape[0], (k,), generator=g)
        x = torch.cat([self._val.x[idx], batch.x[k:]])
        y = torch.cat([self._val.y[idx], batch.y[k:]])
        cat = torch.cat([self._val.cat[idx], batch.cat[k:]])
        return Batch(x, y, cat, batch.tokens)


@dataclass
class Overfitting(FaultInjector):
    """Nothing is injected into a step: the task overfits (a tiny, noisy training set, in the scenario's
    ``extra``). The onset is the eval step with the best validation loss, known once the run is over."""

    kind: ClassVar[str] = "val_vs_train"

    def onset_from_evals(self, best_val: tuple[float, int, Any] | None) -> tuple[int, Any, float] | None:
        return None if best_val is None else (best_val[1], best_val[2], best_val[0])
