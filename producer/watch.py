"""``Watcher``: fills every step event from the model, the optimizer and the clock.

Plain loop::

    watch = rw.watch(model, optimizer, clip=1.0)       # replaces clip_grad_norm_
    for batch in watch.data(loader):
        loss = model(batch).mean()
        loss.backward()
        optimizer.step()                                # hooks measure and clip around it
        optimizer.zero_grad()
        watch.end_step(loss, samples=len(batch))

Cost model: gradient norms (global and per module) every step from one fused norm
over the gradients, which clipping needs anyway; parameter and update norms every
``update_every`` steps from a device copy of the weights kept across that one step.
All figures of a step travel to the host in one small copy; on CUDA that copy is
asynchronous and read one step later, so the GPU is never made to wait.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runwatch.producer.categories import CategoryLossBatch
from runwatch.producer.gradstats import GradNorms, ParamLayout, UpdateNorms, UpdateProbe, grad_norms
from runwatch.producer.heartbeat import Heartbeat
from runwatch.producer.memory import MemorySampler
from runwatch.producer.runtime import StepClock, mfu, peak_flops, transformer_flops_per_step
from runwatch.producer.schema import CategoryLoss

if TYPE_CHECKING:
    import torch

    from runwatch.producer.publisher import RunWatch


@dataclass
class _PendingStep:
    """A step whose device figures are on their way to the host."""

    step: int
    fields: dict[str, Any]
    host: torch.Tensor  # filled by the copy
    ready: Any = None  # a CUDA event when the copy is asynchronous
    grad: bool = False
    update: bool = False
    clipped: bool = False
    has_loss: bool = False
    categories: CategoryLossBatch | None = None
    module_names: list[str] = field(default_factory=list)


class Watcher:
    """Instruments one model and optimizer for one rank; publishes through ``rw``."""

    def __init__(
        self,
        rw: RunWatch,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        clip: float | None = None,
        update_every: int = 10,
        module_norms: bool = True,
        hooks: bool = True,
        external_clip: float | None = None,
        heartbeat_s: float | None = 5.0,
        flops_per_step: float | None = None,
        peak_flops_per_s: float | None = None,
        memory: bool = True,
        first_step: int = 0,
    ):
        if clip is not None and external_clip is not None:
            raise ValueError("give clip (runwatch clips) or external_clip (something else clips), not both")
        for name, value in (("clip", clip), ("external_clip", external_clip)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        if update_every < 0:
            raise ValueError(f"update_every must be >= 0 (0 turns update norms off), got {update_every}")
        self.rw = rw
        self.model = model
        self.optimizer = optimizer
        self.clip = clip
        self.external_clip = external_clip
        self.update_every = update_every
        self.module_norms = module_norms
        self.flops_per_step = flops_per_step
        self.step = first_step  # the number the next end_step() publishes
        self.layout = ParamLayout(model)
        self._probe = UpdateProbe(self.layout)
        self._cuda = self.layout.device.type == "cuda"
        self._peak = peak_flops(self.layout.device, override=peak_flops_per_s)
        self._grad: GradNorms | None = None
        self._update: UpdateNorms | None = None
        self._pending: _PendingStep | None = None
        self._closed = False
        self.heartbeat = Heartbeat(rw, heartbeat_s) if heartbeat_s else None
        self.clock = StepClock(
            on_wait_begin=(lambda: self.heartbeat.push("dataload")) if self.heartbeat else None,
            on_wait_end=self.heartbeat.pop if self.heartbeat else None,
        )
        self._memory = MemorySampler(self.layout.device) if memory else None
        self._hook_handles: list[Any] = []
        if hooks:
            self._hook_handles = [
                optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.before_optimizer_step()),
                optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: self.after_optimizer_step()),
            ]
        if self.heartbeat:
            self.heartbeat.start()
        self.clock.start()

    # -- the three calls around a step ----------------------------------------------------

    def before_optimizer_step(self) -> None:
        """After backward (and AMP unscale), before ``optimizer.step()``."""
        clip = self.clip if self.clip is not None else self.external_clip
        self._grad = grad_norms(self.layout, clip, apply_clip=self.clip is not None)
        if self.update_every and self.step % self.update_every == 0:
            self._probe.arm()

    def after_optimizer_step(self) -> None:
        """Right after ``optimizer.step()``."""
        if self._probe.armed:
            self._update = self._probe.measure()

    def end_step(
        self,
        loss: torch.Tensor | float | None,
        *,
        step: int | None = None,
        samples: int | None = None,
        tokens: int | None = None,
        category_loss: CategoryLossBatch | None = None,
    ) -> None:
        """Publish the step event. Never raises into the training loop for telemetry reasons."""
        import torch

        step = self.step if step is None else step
        step_time, data_wait = self.clock.lap()
        fields: dict[str, Any] = {
            "lr": [float(g["lr"]) for g in self.optimizer.param_groups],
            "data_wait_s": data_wait,
        }
        if step_time is not None and step_time > 0:
            fields["step_time_s"] = step_time
            if samples:
                fields["samples_per_s"] = samples / step_time
            if tokens:
                fields["tokens_per_s"] = tokens / step_time
            flops = self.flops_per_step or (transformer_flops_per_step(self.layout.n_params, tokens) if tokens else None)
            utilisation = mfu(flops, step_time, self._peak)
            if utilisation is not None:
                fields["mfu"] = utilisation
        memory = self._memory.sample() if self._memory else None
        if memory is not None:
            fields["memory"] = memory

        pieces: list[torch.Tensor] = []
        pending = _PendingStep(step=step, fields=fields, host=torch.empty(0), categories=category_loss,
                               module_names=self.layout.module_names if self.module_norms else [])
        if isinstance(loss, torch.Tensor):
            pieces.append(loss.detach().reshape(-1)[:1].double())
            pending.has_loss = True
        elif loss is not None:
            fields["loss"] = float(loss)
        grad, self._grad = self._grad, None
        if grad is not None:
            pending.grad = True
            pending.clipped = self.clip is not None or self.external_clip is not None
            pieces.append(torch.stack([grad.total, grad.clip_coef, grad.nonfinite.double()]))
            if self.module_norms:
                pieces.append(grad.modules)
        update, self._update = self._update, None
        if update is not None:
            pending.update = True
            pieces.append(torch.stack([update.param, update.update]))
        if category_loss is not None:
            pieces.append(category_loss.packed())

        self._ship(pending, pieces)
        self.step = step + 1
        if self.heartbeat:
            self.heartbeat.set_step(step)

    # -- helpers for the rest of the loop ----------------------------------------------------

    def data(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Wrap the data iterator so the time spent waiting for batches is measured."""
        return self.clock.wrap(iterable)

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """Mark a phase (``eval``, ``checkpoint``, ...) for the heartbeat, as a context manager."""
        return self.heartbeat.phase(name) if self.heartbeat else contextlib.nullcontext()

    def eval(
        self,
        step: int,
        split: str = "val",
        loss: float | None = None,
        metrics: dict[str, float] | None = None,
        per_category: dict[str, Any] | CategoryLossBatch | None = None,
    ) -> bool:
        """Publish an eval event; ``per_category`` may be a ``category_loss`` batch."""
        return self.rw.eval(step, split=split, loss=loss, metrics=metrics or {},
                            per_category=_per_category_metrics(per_category))

    def close(self) -> None:
        """Publish the last pending step, stop the heartbeat and remove the hooks (``rw`` stays open)."""
        if self._closed:
            return
        self._closed = True
        self._flush_pending()
        for handle in self._hook_handles:
            handle.remove()
        if self.heartbeat:
            self.heartbeat.stop()

    # -- the single device-to-host copy ---------------------------------------------------

    def _ship(self, pending: _PendingStep, pieces: list[torch.Tensor]) -> None:
        import torch

        if pieces:
            with torch.no_grad():
                packed = torch.cat([p.to(self.layout.device) for p in pieces])
            if self._cuda:
                # Asynchronous copy into pinned memory, read at the next step: no stall of the GPU.
                pending.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                pending.host.copy_(packed, non_blocking=True)
                pending.ready = torch.cuda.Event()
                pending.ready.record()
            else:
                pending.host = packed
        previous, self._pending = self._pending, pending
        if previous is not None:
            self._publish(previous)
        if not self._cuda:
            self._flush_pending()

    def _flush_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._publish(pending)

    def _publish(self, p: _PendingStep) -> None:
        if p.ready is not None:
            p.ready.synchronize()
        values = p.host.tolist() if p.host.numel() else []
        fields = p.fields
        i = 0
        if p.has_loss:
            fields["loss"] = values[i]
            i += 1
        clipped_norm = None
        if p.grad:
            total, coef, nonfinite = values[i:i + 3]
            i += 3
            fields["grad_norm"] = total
            fields["nonfinite_grads"] = int(nonfinite)
            clipped_norm = total * coef
            if p.clipped:
                fields["grad_norm_clipped"] = clipped_norm
                fields["clip_ratio"] = coef
            if p.module_names:
                n = len(p.module_names)
                fields["module_grad_norms"] = dict(zip(p.module_names, values[i:i + n], strict=True))
                i += n
        if p.update:
            param, update = values[i:i + 2]
            i += 2
            fields["param_norm"] = param
            fields["update_norm"] = update
            if param > 0:
                fields["relative_update_norm"] = update / param
            if clipped_norm is not None and clipped_norm > 0 and math.isfinite(clipped_norm):
                fields["effective_lr_ratio"] = update / clipped_norm
        if p.categories is not None:
            fields["category_loss"] = p.categories.from_packed(values[i:])
        self.rw.step(p.step, **fields)


def _per_category_metrics(per_category: dict[str, Any] | CategoryLossBatch | None) -> dict[str, dict[str, float]]:
    if per_category is None:
        return {}
    if isinstance(per_category, CategoryLossBatch):
        per_category = per_category.resolve()
    out: dict[str, dict[str, float]] = {}
    for name, value in per_category.items():
        if isinstance(value, CategoryLoss):
            out[name] = {"loss": value.mean, "count": float(value.count)}
        elif isinstance(value, dict):
            out[name] = {k: float(v) for k, v in value.items()}
        else:
            out[name] = {"loss": float(value)}
    return out

