"""Fault injectors: one class per fault kind, its mechanism chosen by explicit parameters.

A scenario's training loop (:mod:`.training` for the recorded scenarios, the demo's regressor loop)
calls every hook at a fixed point of each step; an injector changes only what its fault needs and
leaves the rest alone, so the loop itself never asks which fault it runs. The catalog holds one
configured injector per scenario; :meth:`FaultInjector.for_run` gives each run a fresh copy, whose
:meth:`~FaultInjector.start` binds it to that run (the onset step, the model, the clock).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self, cast

import torch
import torch.nn.functional as F
from torch import nn

from runwatch.scenarios.tasks import Batch, Task, TinyTransformer


@dataclass
class FaultRun:
    """What an injector may know about the run it is injected into."""

    onset: int | None  # the step the fault starts at (None: no fault)
    steps: int
    model: nn.Module
    seed: int = 0
    step_time_s: float = 0.0  # the scenario's modelled compute time per step
    base_lr: Callable[[int], float] = lambda _step: 0.0  # the schedule's LR at a step
    mark_onset: Callable[[], None] = lambda: None  # record the onset's wall time (once)


@dataclass
class FaultInjector:
    """No fault: every hook leaves the step as it is. Subclasses override the hooks their fault needs."""

    kind: ClassVar[str] = "healthy"

    def for_run(self) -> Self:
        return dataclasses.replace(self)

    def start(self, run: FaultRun) -> None:
        self.run = run

    # -- what the labels and the recorded config say about the fault
    def describe(self) -> dict[str, Any]:
        """``module``, ``category``, ``kind`` and ``magnitude`` (None where they do not apply)."""
        return {"module": None, "category": None, "kind": None, "magnitude": None}

    def label_fields(self) -> dict[str, Any]:
        fields = {k: v for k, v in self.describe().items() if k != "magnitude" and v is not None}
        magnitude = self.describe()["magnitude"]
        if magnitude is not None:
            fields["magnitude"] = magnitude if math.isfinite(magnitude) else str(magnitude)
        return fields

    # -- when
    def active(self, step: int) -> bool:
        return self.run.onset is not None and step >= self.run.onset

    def at_onset(self, step: int) -> bool:
        return self.run.onset is not None and step == self.run.onset

    # -- the hooks, in the order a step calls them
    def data_wait(self, step: int, wait: float, timing: random.Random) -> float:
        return wait

    def batch_length(self, step: int) -> int | None:
        return None

    def corrupt(self, task: Task | None, batch: Batch, step: int) -> Batch:
        return batch

    def optimizer(self, step: int, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the loop steps from this step on (a fault may replace it)."""
        return optimizer

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        pass

    def forward(self, model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
        return cast(torch.Tensor, model(x))

    def loss(self, loss: torch.Tensor, logits: torch.Tensor, step: int) -> torch.Tensor:
        return loss

    def backward_loss(
        self, loss: torch.Tensor, per_sample: torch.Tensor, batch: Batch, step: int
    ) -> torch.Tensor:
        return loss

    def retain(self, model: nn.Module, batch: Batch, logits: torch.Tensor, step: int) -> list[int]:
        """Bytes of the tensors this step keeps alive for good (the memory model allocates them)."""
        return []

    def compute_time(self, seconds: float, step: int) -> float:
        return seconds

    def step_computed(self, step: int) -> None:
        """The step's compute time has passed: a fault that starts here has its onset now."""
        if self.at_onset(step):
            self.run.mark_onset()

    def step_published(self, step: int, advance: Callable[[float], None]) -> str | None:
        """After the step's event: the run_end status if the run ends here, else None."""
        return None

    def onset_from_evals(self, best_val: tuple[float, int, Any] | None) -> tuple[int, Any, float] | None:
        """(onset step, onset time, best validation loss) where the onset is only known afterwards."""
        return None


Healthy = FaultInjector


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


@dataclass
class BadInit(FaultInjector):
    """A mistake built into the model from step 0 (the randn mel scale): nothing is injected while
    training. Only a comparison with earlier runs of the job, its correctly initialised twin, shows it;
    ``module`` is the owner of the badly initialised parameter."""

    kind: ClassVar[str] = "bad_init"
    module: str

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "module": self.module}


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
class ThroughputDrift(FaultInjector):
    """From the onset steps take ``factor`` times as long, at once or (``ramp``) growing linearly to it by
    the end of the run. ``cause``: the cause the finding must name (``evidence["cause"]``: ``run``,
    ``unknown``, ``contention``), the label's where the run's heartbeats carry host load; None: any."""

    kind: ClassVar[str] = "throughput_drift"
    factor: float
    ramp: bool = False
    cause: str | None = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "magnitude": self.factor}

    def label_fields(self) -> dict[str, Any]:
        cause = {} if self.cause is None else {"cause": self.cause}
        return {**super().label_fields(), **cause}

    def compute_time(self, seconds: float, step: int) -> float:
        if not self.active(step):
            return seconds
        if not self.ramp:
            return seconds * self.factor
        onset, n = self.run.onset, self.run.steps
        assert onset is not None  # active() says so
        return seconds * (1 + (self.factor - 1) * (step - onset + 1) / max(1, n - onset))


@dataclass
class DataWait(FaultInjector):
    """From the onset the wait per batch jumps to about ``jump_to_s`` seconds, or grows linearly to
    ``grow_to_step_times`` times the compute time by the end of the run."""

    kind: ClassVar[str] = "data_wait"
    jump_to_s: float | None = None
    grow_to_step_times: float | None = None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "magnitude": self.jump_to_s or self.grow_to_step_times}

    def data_wait(self, step: int, wait: float, timing: random.Random) -> float:
        if not self.active(step):
            return wait
        if self.jump_to_s is not None:
            return self.jump_to_s * timing.lognormvariate(0, 0.1)
        onset, n = self.run.onset, self.run.steps
        grow = self.grow_to_step_times
        assert onset is not None and grow is not None  # active(), and no jump_to_s: grows
        return wait + grow * self.run.step_time_s * (step - onset + 1) / max(1, n - onset)


@dataclass
class MemoryLeak(FaultInjector):
    """From the onset every step's input, hidden activations and logits are kept in a list never cleared
    (needs a model with an ``encoder`` whose first layer takes the batch); with ``logits_only`` only the
    logits (a smaller leak: a metric buffer that keeps every step's outputs)."""

    kind: ClassVar[str] = "memory_leak"
    logits_only: bool = False

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": "leak"}

    def start(self, run: FaultRun) -> None:
        super().start(run)
        self.retained: list[torch.Tensor] = []

    def retain(self, model: nn.Module, batch: Batch, logits: torch.Tensor, step: int) -> list[int]:
        if not self.active(step):
            return []
        with torch.no_grad():
            encoder = cast(nn.Sequential, model.encoder)  # (the class doc's model)
            h1 = encoder[0](batch.x)
            kept = [batch.x.clone(), h1, F.gelu(h1), encoder(batch.x), logits.detach().clone()]
        if self.logits_only:
            kept = kept[-1:]
        self.retained.extend(kept)  # the bug: a list that is never cleared
        return [t.numel() * t.element_size() for t in kept]


@dataclass
class MemoryFragmentation(FaultInjector):
    """From the onset every batch has a random sequence length between ``min_length`` and ``max_length``."""

    kind: ClassVar[str] = "memory_fragmentation"
    min_length: int = 16
    max_length: int = 256

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": "fragmentation"}

    def start(self, run: FaultRun) -> None:
        super().start(run)
        self.lengths = random.Random(run.seed)

    def batch_length(self, step: int) -> int | None:
        return self.lengths.randint(self.min_length, self.max_length) if self.active(step) else None


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
class Overfitting(FaultInjector):
    """Nothing is injected into a step: the task overfits (a tiny, noisy training set, in the scenario's
    ``extra``). The onset is the eval step with the best validation loss, known once the run is over."""

    kind: ClassVar[str] = "val_vs_train"

    def onset_from_evals(self, best_val: tuple[float, int, Any] | None) -> tuple[int, Any, float] | None:
        return None if best_val is None else (best_val[1], best_val[2], best_val[0])


@dataclass
class Stall(FaultInjector):
    """The rank hangs for ``seconds``: in the training phase after the onset step (the run is then killed),
    or in the data loader before the step after it (then recovers). Heartbeats go on throughout."""

    kind: ClassVar[str] = "stall"
    phase: Literal["train", "dataload"]
    seconds: float

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": self.phase, "magnitude": self.seconds}

    def label_fields(self) -> dict[str, Any]:
        # the label's kind is the finding's ("stalled"); the phase it hangs in is its own field
        return {"phase": self.phase, "kind": "stalled", "magnitude": self.seconds}

    def data_wait(self, step: int, wait: float, timing: random.Random) -> float:
        if self.phase == "dataload" and step == (self.run.onset or 0) + 1:
            self.run.mark_onset()
            return wait + self.seconds
        return wait

    def step_computed(self, step: int) -> None:
        pass  # the onset is when the hang starts, below or in the data wait

    def step_published(self, step: int, advance: Callable[[float], None]) -> str | None:
        if self.phase != "train" or not self.at_onset(step):
            return None
        self.run.mark_onset()
        advance(self.seconds)  # hung: the heartbeats go on, no step completes
        return "interrupted"


@dataclass
class FrozenModules(FaultInjector):
    """At the onset the parameters of ``modules`` stop training (``requires_grad_(False)``, as a fine-tuning
    script that freezes a backbone at the wrong step does): their gradients are gone, the Watcher reports
    0.0 for them, the rest of the model trains on. ``unfreeze_at`` (a fraction of the run; healthy twins):
    they are frozen from step 0 and unfrozen there instead (gradual unfreezing, by design)."""

    kind: ClassVar[str] = "frozen_modules"
    modules: tuple[str, ...]
    unfreeze_at: float | None = None

    def describe(self) -> dict[str, Any]:
        module = self.modules[0] if self.unfreeze_at is None else None
        return {**super().describe(), "module": module, "kind": "frozen" if module else None}

    def _set(self, trainable: bool) -> None:
        named = dict(self.run.model.named_modules())
        for name in self.modules:
            for p in named[name].parameters():
                p.requires_grad_(trainable)

    def start(self, run: FaultRun) -> None:
        super().start(run)
        if self.unfreeze_at is not None:
            self._set(False)

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.unfreeze_at is not None:
            if step == int(round(self.unfreeze_at * self.run.steps)):
                self._set(True)
        elif self.at_onset(step):
            self._set(False)


@dataclass
class GradualUnfreezing(FrozenModules):
    """Healthy: ``modules`` frozen from step 0 and unfrozen at ``unfreeze_at`` of the run, by design."""

    kind: ClassVar[str] = "healthy"


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
class DeadUnits(FaultInjector):
    """At the onset ``frac`` of ``layer``'s output units get a bias pushed far negative (a bad update, a
    corrupted checkpoint shard): the activation module after it (``module``) outputs exactly 0 for them
    from then on, and their gradient is 0, so they stay dead."""

    kind: ClassVar[str] = "activations"
    layer: str
    module: str
    frac: float = 0.9

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "module": self.module, "kind": "dead", "magnitude": self.frac}

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if not self.at_onset(step):
            return
        linear = dict(self.run.model.named_modules())[self.layer]
        bias = cast(torch.Tensor, linear.bias)
        units = torch.randperm(bias.numel(), generator=torch.Generator().manual_seed(self.run.seed))
        with torch.no_grad():
            bias[units[: math.ceil(self.frac * bias.numel())]] -= 1e3


@dataclass
class ActivationGrowth(FaultInjector):
    """From the onset ``module``'s output is multiplied by ``factor`` once more every step (a gain running
    away, a residual branch compounding): nothing in one step looks wrong."""

    kind: ClassVar[str] = "activations"
    module: str
    factor: float = 1.01

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "module": self.module, "kind": "growth", "magnitude": self.factor}

    def start(self, run: FaultRun) -> None:
        super().start(run)
        self._scale = 1.0
        target = dict(run.model.named_modules())[self.module]
        # prepend: the watcher's own hook (registered before) sees the scaled output, as the next layer does
        target.register_forward_hook(lambda _m, _i, out: out * self._scale, prepend=True)

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.active(step):
            self._scale = self.factor ** (step - cast(int, self.run.onset) + 1)
