"""Memory figures for CPU scenario runs: measured host RSS plus a model of the CUDA caching allocator."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runwatch.producer.instrument.memory import MemorySampler
from runwatch.producer.wire.schema import MemoryStats


class CachingAllocatorModel:
    """A deliberately simple model of the CUDA caching allocator, for CPU runs.

    Requests are rounded up to 512 bytes. A freed block stays cached (reserved) and is reused
    only by a later request of the same rounded size; there is no splitting, merging or
    ``empty_cache``. Fixed shapes therefore reach a plateau after the first step; tensors that
    are never freed make ``allocated`` (and ``reserved``) grow; shapes that keep changing leave
    cached blocks of the wrong size behind, so ``reserved - allocated`` grows. The real
    allocator splits and merges blocks, which softens (but does not remove) that last effect.
    """

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self._free: dict[int, int] = {}  # rounded size -> cached free blocks

    @staticmethod
    def _round(nbytes: int) -> int:
        return max(512, (nbytes + 511) // 512 * 512)

    def alloc(self, nbytes: int) -> int:
        size = self._round(nbytes)
        if self._free.get(size, 0) > 0:
            self._free[size] -= 1
        else:
            self.reserved += size
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        return size

    def free(self, size: int) -> None:
        self.allocated -= size
        self._free[size] = self._free.get(size, 0) + 1


class ScenarioMemory:
    """``sample()`` for the Watcher: host figures of this process plus the allocator model's."""

    def __init__(self, model: nn.Module):
        self.allocator = CachingAllocatorModel()
        self.host = MemorySampler("cpu")
        self._activations: list[int] = []
        self._grads: list[int] = []
        self._persistent_done = False
        self._param_bytes = [p.numel() * p.element_size() for p in model.parameters()]
        for p in self._param_bytes:  # weights live for the whole run
            self.allocator.alloc(p)
        for module in model.modules():
            if not list(module.children()):
                module.register_forward_hook(self._record)

    def _record(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and torch.is_grad_enabled():
            self._activations.append(output.numel() * output.element_size())

    def after_step(self, retained: list[int] = ()) -> None:  # type: ignore[assignment]
        """Replay this step's allocations: activations, gradients, retained tensors, then the frees."""
        a = self.allocator
        if not self._persistent_done:  # Adam's two moments appear at the first step and stay
            for p in self._param_bytes:
                a.alloc(p)
                a.alloc(p)
            self._persistent_done = True
        for size in self._grads:  # zero_grad(set_to_none=True) frees the previous step's gradients
            a.free(size)
        acts = [a.alloc(n) for n in self._activations]
        self._grads = [a.alloc(n) for n in self._param_bytes]
        for n in retained:
            a.alloc(n)  # never freed
        for size in acts:  # backward frees the activations
            a.free(size)
        self._activations.clear()

    def sample(self) -> MemoryStats | None:
        host = self.host.sample()
        fields = host.model_dump(exclude_none=True) if host is not None else {}
        a = self.allocator
        return MemoryStats(**fields, allocated=a.allocated, reserved=a.reserved, peak=a.peak)
