"""``Watcher``'s options: checked, and turned into what the watcher uses (samplers, the guard, DDP's timer).

Run once, when ``rw.watch`` builds its watcher; nothing here is on the per-step path but :func:`lr_list`,
for a step given its own ``lr``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from runwatch.producer.instrument.ddp_timing import DDPSyncTimer, is_ddp
from runwatch.producer.instrument.gradstats import ParamLayout, ShardSpec
from runwatch.producer.instrument.guard import GuardOptions, StepGuard
from runwatch.producer.instrument.heartbeat import Heartbeat
from runwatch.producer.instrument.memory import MemorySampler

if TYPE_CHECKING:
    import torch

# The watcher's warnings keep the watcher's logger, wherever their code sits: users filter on its name.
log = logging.getLogger("runwatch.producer.instrument.watch")


def check_options(
    clip: float | None, external_clip: float | None, update_every: int, shard: ShardSpec | None
) -> None:
    """Raise ``ValueError`` for a combination of ``Watcher`` options that cannot work."""
    if shard is not None and clip is not None:
        raise ValueError(
            "clip= cannot be used with shard=: clipping a sharded model needs the global gradient "
            "norm across ranks. Clip with your framework (e.g. FSDP's model.clip_grad_norm_) "
            "and pass external_clip= instead"
        )
    if clip is not None and external_clip is not None:
        raise ValueError("give clip (runwatch clips) or external_clip (something else clips), not both")
    for name, value in (("clip", clip), ("external_clip", external_clip)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if update_every < 0:
        raise ValueError(f"update_every must be >= 0 (0 turns update norms off), got {update_every}")


def lr_list(lr: float | Sequence[float] | None) -> list[float] | None:
    """An LR given by the caller, as the step event's per-param-group list."""
    if lr is None:
        return None
    if isinstance(lr, Sequence):
        return [float(x) for x in lr]
    return [float(lr)]  # a number (or a 0-d tensor)


def memory_source(memory: bool | Any, device: torch.device) -> Any:
    """``Watcher``'s ``memory`` option as the sampler it reads: True a :class:`MemorySampler` of
    ``device``, False None, anything else (an object with ``sample()``) itself."""
    if isinstance(memory, bool):
        return MemorySampler(device) if memory else None
    return memory


def gpu_source(gpu_health: bool | Any, device: torch.device, simulated: bool) -> Any:
    """``Watcher``'s ``gpu_health`` option as the sampler the heartbeat calls: True a
    :class:`~runwatch.producer.instrument.gpu_health.GpuHealthSampler` of a CUDA ``device`` (its index, else
    the current device: what LOCAL_RANK's ``torch.cuda.set_device`` chose) on the wall clock, else None;
    False None; anything else itself. Makes no NVML call (the sampler's first ``sample`` does, on the
    heartbeat thread)."""
    if not isinstance(gpu_health, bool):
        return gpu_health
    if not gpu_health or simulated or device.type != "cuda":
        return None
    from runwatch.producer.instrument.gpu_health import GpuHealthSampler, nvml_device_for

    try:
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        return GpuHealthSampler(nvml_device_for(index), cuda_device=index)
    except Exception as exc:  # noqa: BLE001 - no GPU health is no reason to fail the watch
        log.warning("runwatch: no GPU health for %s: %r", device, exc)
        return None


def step_guard(guard: bool | GuardOptions, layout: ParamLayout) -> StepGuard | None:
    """The guard before each update (guard.py); none when turned off, or for a shard: its ranks
    would judge different norms and skip different steps, and their weights would drift apart."""
    if guard is False:
        return None
    if layout.sharded:
        log.info("runwatch: the step guard is off for a sharded model (shard=): ranks see different norms")
        return None
    return StepGuard(guard if isinstance(guard, GuardOptions) else None)


def ddp_sync_timer(
    model: torch.nn.Module, clock: Callable[[], float], layout: ParamLayout, heartbeat: Heartbeat | None
) -> DDPSyncTimer | None:
    """A timer of DDP's gradient sync, registered as ``model``'s comm hook; None unless ``model`` is
    a ``DistributedDataParallel`` that took the hook. The heartbeat reports its ``in_sync``."""
    if not is_ddp(model):
        return None
    timer = DDPSyncTimer(clock, layout.device)
    if not timer.register(model):
        return None
    if heartbeat:
        heartbeat.in_sync = timer.in_sync
    return timer
