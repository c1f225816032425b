"""Memory figures for CPU scenario runs: measured host RSS plus a model of the CUDA caching allocator."""

from __future__ import annotations

import mmap
from typing import Any

import torch
from torch import nn

from runwatch.contract.schema import MemoryStats
from runwatch.producer.instrument.memory import MemorySampler


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


class HostSwings:
    """Host memory a CPU run takes around its evals and checkpoints, for the healthy scenarios with RSS
    swings (``extra["rss_swing_mib"]``, ``extra["rss_ratchet_mib"]``; without them every hook does
    nothing): anonymous mappings really touched, so the measured host RSS moves by their size, and
    unmapped where the memory is given back, so it really comes back.

    After each eval ``eval_mib`` MiB (default ``mib``) of eval buffers stay mapped for ``hold`` steps. A
    data cache of ``mib`` MiB is filled over the first ``refill`` steps, dropped at each checkpoint and
    refilled over the ``refill`` steps after it: the RSS falls by ``mib`` and climbs back, steadily, to
    where it was.

    A ratchet (``ratchet_mib`` MiB at each of the first ``ratchet_evals`` evals): an eval whose batches
    are larger than any before it raises the allocator's high-water mark, and the allocator keeps the
    freed pages (glibc's heap is not trimmed), so the RSS steps up at that eval and stays up; once the
    largest eval batch has been seen, later evals fit in the kept pages and the RSS plateaus. Modelled as
    a mapping touched at the eval and never unmapped.
    """

    PAGE = 4096

    def __init__(
        self,
        mib: int,
        hold: int = 12,
        refill: int = 20,
        eval_mib: int | None = None,
        ratchet_mib: int = 0,
        ratchet_evals: int = 0,
    ):
        self.mib, self.hold, self.refill = mib, hold, refill
        self.eval_mib = mib if eval_mib is None else eval_mib
        self.ratchet_mib, self.ratchet_evals = ratchet_mib, ratchet_evals
        self._eval: list[tuple[int, mmap.mmap]] = []  # (step to release after, buffer)
        self._cache: list[mmap.mmap] = []
        self._kept: list[mmap.mmap] = []  # the ratchet's pages: never given back

    @classmethod
    def for_scenario(cls, extra: dict[str, Any]) -> HostSwings:
        return cls(
            extra.get("rss_swing_mib", 0),
            extra.get("rss_swing_hold", 12),
            extra.get("rss_swing_refill", 20),
            extra.get("rss_swing_eval_mib"),
            extra.get("rss_ratchet_mib", 0),
            extra.get("rss_ratchet_evals", 0),
        )

    def _mapped(self, nbytes: int) -> mmap.mmap:
        buffer = mmap.mmap(-1, nbytes)
        for offset in range(0, nbytes, self.PAGE):  # touch every page: resident from now on
            buffer[offset] = 1
        return buffer

    def after_step(self, step: int) -> None:
        """Release the eval buffers whose time is up; add one chunk to the cache while it refills."""
        for entry in [e for e in self._eval if e[0] <= step]:
            entry[1].close()
            self._eval.remove(entry)
        if self.mib and len(self._cache) < self.refill:
            self._cache.append(self._mapped(self.mib * (1 << 20) // self.refill))

    def after_eval(self, step: int) -> None:
        if self.eval_mib:
            self._eval.append((step + self.hold, self._mapped(self.eval_mib * (1 << 20))))
        if self.ratchet_mib and len(self._kept) < self.ratchet_evals:
            self._kept.append(self._mapped(self.ratchet_mib * (1 << 20)))

    def at_checkpoint(self) -> None:
        for buffer in self._cache:
            buffer.close()
        self._cache.clear()
