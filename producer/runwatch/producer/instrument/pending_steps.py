"""``PendingSteps``: the single device-to-host copy of each step's figures, and the step event it becomes.

``Watcher.end_step`` packs a step's device figures (:class:`~runwatch.producer.instrument.step_packing.
StepPacking`) and hands the step here. On CUDA the copy is asynchronous, into reused pinned memory, and
the step is published once it has arrived (at most ``MAX_PENDING_COPIES`` steps wait; then the oldest is
waited for), so neither the GPU nor the loop waits on runwatch; elsewhere it is published at once. The
figures become the step event's fields (norms, clip ratio, update ratios, digests, activations,
category loss, compute time) and go to the publisher, in step order.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runwatch.producer.instrument.activations import activation_stats
from runwatch.producer.instrument.categories import CategoryLossBatch
from runwatch.producer.instrument.ddp_timing import DDPSyncTimer, SyncRound
from runwatch.producer.instrument.fingerprint import ReplicaFingerprint
from runwatch.producer.instrument.gradstats import HostGradNorms, ParamLayout
from runwatch.producer.instrument.step_packing import StepPacking

if TYPE_CHECKING:
    import torch

# CUDA: steps whose device-to-host copy may still be under way before end_step waits for the oldest.
MAX_PENDING_COPIES = 4


@dataclass
class PendingStep:
    """A step whose device figures are on their way to the host."""

    step: int
    fields: dict[str, Any]
    packing: StepPacking  # which figures the copy holds, by name
    host: torch.Tensor | None = None  # filled by the copy
    ready: Any = None  # a CUDA event when the copy is asynchronous
    clipped: bool = False
    # the gradient figures when they are host numbers already (not in the copy)
    grad: HostGradNorms | None = None
    categories: CategoryLossBatch | None = None
    sync: SyncRound | None = None  # DDP: the step's sync marks, for compute_s
    off_step: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of off-step stretches
    activations: list[tuple[str, int]] = field(default_factory=list)  # modules in the copy, element counts


class PendingSteps:
    """The steps of one watcher whose copy is under way, published in step order through ``publish``
    (``(step, fields)``). ``module_norms``: whether step events carry the per-module gradient norms;
    ``sync_timer``: DDP's sync timer, for ``compute_s``."""

    def __init__(
        self,
        layout: ParamLayout,
        publish: Callable[[int, dict[str, Any]], Any],
        *,
        module_norms: bool,
        sync_timer: DDPSyncTimer | None,
    ) -> None:
        self.layout = layout
        self._publish_fields = publish
        self.module_norms = module_norms
        self.sync_timer = sync_timer
        self._cuda = layout.device.type == "cuda"
        self._pending: deque[PendingStep] = deque()  # steps whose figures are on their way to the host
        self._host_buffers = _HostBuffers()

    def ship(self, pending: PendingStep) -> None:
        """Start ``pending``'s copy, and publish the steps whose copy is done (all of them off CUDA)."""
        packed = pending.packing.pack(self.layout.device)
        if packed is not None:
            if self._cuda:
                # Asynchronous copy into pinned memory (reused), published once the copy is done: the
                # GPU is never made to wait, and neither is the loop unless the GPU is far behind.
                pending.host, pending.ready = self._host_buffers.take(packed.numel())
                pending.host.copy_(packed, non_blocking=True)
                pending.ready.record()
            else:
                pending.host = packed
        self._pending.append(pending)
        self.publish_done(keep=MAX_PENDING_COPIES if self._cuda else 0)

    def publish_done(self, keep: int) -> None:
        """Publish, in step order, the pending steps whose copy has arrived, and the oldest beyond ``keep``
        (waiting for those)."""
        while self._pending:
            head = self._pending[0]
            if len(self._pending) <= keep and head.ready is not None and not head.ready.query():
                return
            self._pending.popleft()
            self.publish(head)

    def flush(self) -> None:
        """Publish every pending step, waiting for the copies still under way."""
        self.publish_done(keep=0)

    def publish(self, p: PendingStep) -> None:
        """``p``'s figures, once on the host, as its step event's fields, to the publisher."""
        if p.ready is not None:
            p.ready.synchronize()  # returns at once when the copy is done (the usual case)
        values = p.host.tolist() if p.host is not None else []
        if p.ready is not None:
            self._host_buffers.give_back(p.host, p.ready)
        figures = p.packing.unpack(values)
        if p.grad is not None:
            figures.update(
                grad=p.grad.figures, clip_coef=[p.grad.clip_coef], nonfinite_grads=[p.grad.nonfinite]
            )
        fields = p.fields
        if "loss" in figures:
            fields["loss"] = figures["loss"][0]
        clipped_norm = None
        if "grad" in figures:
            grad = figures["grad"]
            total, coef = grad[-1], figures["clip_coef"][0]
            fields["grad_norm"] = total
            fields["nonfinite_grads"] = int(figures["nonfinite_grads"][0])
            clipped_norm = total * coef
            if p.clipped:
                fields["grad_norm_clipped"] = clipped_norm
                fields["clip_ratio"] = coef
            if self.module_norms:
                fields["module_grad_norms"] = dict(zip(self.layout.module_names, grad[:-1], strict=True))
        if "update" in figures:
            param, update = figures["update"]
            fields["param_norm"] = param
            fields["update_norm"] = update
            if not self.layout.sharded:  # a shard's ratios are not the model's: the worker's join has those
                if param > 0:
                    fields["relative_update_norm"] = update / param
                if clipped_norm is not None and clipped_norm > 0 and math.isfinite(clipped_norm):
                    fields["effective_lr_ratio"] = update / clipped_norm
        if "param_digest" in figures:
            fields["param_digest"] = ReplicaFingerprint.digest(figures["param_digest"])
        if "activations" in figures:
            fields["module_activations"] = activation_stats(figures["activations"], p.activations)
        if p.categories is not None:
            fields["category_loss"] = p.categories.from_packed(figures["category_loss"])
        if p.sync is not None and self.sync_timer is not None:
            compute = self.sync_timer.compute_s(p.sync, p.off_step)
            if compute is not None:
                fields["compute_s"] = compute
        self._publish_fields(p.step, fields)


class _HostBuffers:
    """Pinned host buffers and their CUDA events, reused: pinning memory and creating events every step
    costs more host time than the step's whole copy."""

    def __init__(self) -> None:
        self._free: dict[int, list[tuple[Any, Any]]] = {}

    def take(self, size: int) -> tuple[Any, Any]:
        import torch

        free = self._free.get(size)
        if free:
            return free.pop()
        buffer = torch.empty(size, dtype=torch.float64, pin_memory=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call] # torch leaves cuda.Event unannotated
        return buffer, event

    def give_back(self, host: Any, ready: Any) -> None:
        free = self._free.setdefault(host.numel(), [])
        if len(free) <= MAX_PENDING_COPIES:
            free.append((host, ready))
