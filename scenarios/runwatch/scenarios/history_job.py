"""One job's training at one commit, for the history corpus (:mod:`.history`).

The job trains the fixed-init :class:`~runwatch.scenarios.tasks.TinyAudioNet` with the shared
scenario loop (:func:`~runwatch.scenarios.training.run_scenario`). A commit's code state is a
:class:`JobConfig` (the repository's ``train_config.json``); :class:`JobAtCommit` is the injector that
makes the loop train that state, on one declared hardware, with the run-to-run noise of a rerun:

* the job's seed is fixed (same init, same data), as in a benchmark job; what differs between runs is a
  per-run augmentation seed (a small dB dither on the log-mel frames) and the machine's timing jitter,
  so reruns of one commit differ the way reruns do, not the way different seeds do;
* the hardware is declared (``cpu-a`` / ``cpu-b``: a modelled step time and a declared peak FLOP/s, so
  that MFU exists on a CPU);
* the regressions are real changes to the training: a slower loop, two more copies of the weights kept
  on the device, smaller micro-batches on an overhead-bound device, a longer LR warm-up, a training
  mix without one class, the randn mel-scale init.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from runwatch.contract.schema import MemoryStats
from runwatch.producer.instrument.runtime import transformer_flops_per_step
from runwatch.producer.publish.recorder import JsonlRecorder
from runwatch.scenarios.faults import FaultInjector, FaultRun
from runwatch.scenarios.scenario import Scenario
from runwatch.scenarios.tasks import AudioTask, Batch, Task

# Declared hardware: what one step of the job costs there and the peak FLOP/s MFU is measured against
# (made-up figures for two simulated CPU hosts; a real run declares its device's peak).
HARDWARE: dict[str, dict[str, float]] = {
    "cpu-a": {"step_time_s": 0.30, "peak_flops_per_s": 2.0e8},
    "cpu-b": {"step_time_s": 0.24, "peak_flops_per_s": 2.5e8},
}
POSITIONS_PER_SAMPLE = 16  # TinyAudioNet's frames after the stride-2 conv: the "tokens" of 6·N·tokens
DITHER_DB = 0.2  # the per-run augmentation: N(0, 0.2 dB) on every frame
STEP_TIME_JITTER = 0.02  # per step (log-normal sigma), on top of the loop's own noise
RUN_TIME_JITTER = 0.01  # per run: the machine is a little faster or slower today


@dataclass(frozen=True)
class JobConfig:
    """The job's ``train_config.json`` at one commit."""

    model: str = "audio_fixed"  # audio: the randn mel-scale init (the bad one)
    seed: int = 0
    batch: int = 16
    lr: float = 1e-3
    warmup_share: float | None = None  # a linear warm-up over this share of the steps, then cosine
    loop_overhead: float = 1.0  # the step's compute time, relative (a per-step sync makes it 1.2)
    step_time_scale: float = 1.0  # the compute of a larger batch, relative (declared with a new baseline)
    ema_weight_copies: int = 0  # extra fp32 copies of the weights kept on the device
    train_mix_without: str | None = None  # a class whose training shard was replaced by ...
    train_mix_by: str = "music"  # ... a second shard of this class
    augment_seed_base: int = 1000
    note: str = ""  # the comment edits of noise-only commits

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class JobAtCommit(FaultInjector):
    """Trains ``config`` on ``hardware`` with this run's noise (``noise_seed``)."""

    kind: ClassVar[str] = "history"
    config: JobConfig = JobConfig()
    noise_seed: int = 0
    peak_lr: float = 1e-3

    def start(self, run: FaultRun) -> None:
        super().start(run)
        self.rng = random.Random(self.noise_seed)
        self.dither = torch.Generator().manual_seed(self.noise_seed)
        self.run_factor = math.exp(self.rng.gauss(0.0, RUN_TIME_JITTER))
        self.ema: list[torch.Tensor] = []

    def data_wait(self, step: int, wait: float, timing: random.Random) -> float:
        return wait * math.exp(self.rng.gauss(0.0, 0.2))

    def corrupt(self, task: Task | None, batch: Batch, step: int) -> Batch:
        x, y, cat = batch.x, batch.y, batch.cat
        missing = self.config.train_mix_without
        if missing is not None and isinstance(task, AudioTask):
            # The shard of ``missing`` was replaced by a second shard of ``train_mix_by``: its rows become
            # samples of that class (the raised band moved to its bins), so training never sees ``missing``.
            k, j = task.names.index(missing), task.names.index(self.config.train_mix_by)
            rows = y == k
            if bool(rows.any()):
                x = x.clone()
                band = x.shape[2] // len(task.names)
                moved = x[rows]
                own, other = (
                    moved[:, :, k * band : (k + 1) * band].clone(),
                    moved[:, :, j * band : (j + 1) * band].clone(),
                )
                moved[:, :, k * band : (k + 1) * band], moved[:, :, j * band : (j + 1) * band] = other, own
                x[rows] = moved
                y = torch.where(rows, torch.full_like(y, j), y)
                cat = torch.where(rows, torch.full_like(cat, j), cat)
        x = x + DITHER_DB * torch.randn(x.shape, generator=self.dither)
        return Batch(x, y, cat, batch.tokens)

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        share = self.config.warmup_share
        if share is None:
            return
        warmup = max(1, int(share * self.run.steps))
        if step < warmup:
            factor = (step + 1) / warmup
        else:
            factor = 0.1 + 0.9 * 0.5 * (
                1 + math.cos(math.pi * (step - warmup) / max(1, self.run.steps - warmup))
            )
        for group in optimizer.param_groups:
            group["lr"] = self.peak_lr * factor

    def retain(self, model: nn.Module, batch: Batch, logits: torch.Tensor, step: int) -> list[int]:
        if not self.config.ema_weight_copies:
            return []
        with torch.no_grad():
            if not self.ema:  # the EMA weights (and the eval model's copy of them) live for the whole run
                self.ema = [
                    p.detach().clone()
                    for _ in range(self.config.ema_weight_copies)
                    for p in model.parameters()
                ]
                return [t.numel() * t.element_size() for t in self.ema]
            params = list(model.parameters())
            for i, shadow in enumerate(self.ema):
                shadow.mul_(0.999).add_(params[i % len(params)].detach(), alpha=0.001)
        return []

    def compute_time(self, seconds: float, step: int) -> float:
        scale = self.config.loop_overhead * self.config.step_time_scale * self.run_factor
        return seconds * scale * math.exp(self.rng.gauss(0.0, STEP_TIME_JITTER))


class DeviceMemoryOnly:
    """The emulated allocator's figures without this process's host RSS: every run of the corpus is
    recorded by one process, so its RSS is not any one run's."""

    def __init__(self, inner: Any):
        self.inner = inner

    def sample(self) -> MemoryStats | None:
        stats = self.inner.sample()
        if stats is None:
            return None
        return MemoryStats(allocated=stats.allocated, reserved=stats.reserved, peak=stats.peak)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class DeclaredHardwareRecorder(JsonlRecorder):
    """A JsonlRecorder whose watcher counts the job's FLOPs per step (6·N·positions) against the declared
    hardware's peak, so MFU exists on a CPU, and reports device memory only."""

    def __init__(self, *args: Any, peak_flops_per_s: float, batch: int, **kwargs: Any):
        self.peak_flops_per_s = peak_flops_per_s
        self.batch = batch
        super().__init__(*args, **kwargs)

    def watch(self, model: Any, optimizer: Any = None, **options: Any) -> Any:
        n_params = sum(p.numel() for p in model.parameters())
        options["flops_per_step"] = transformer_flops_per_step(n_params, self.batch * POSITIONS_PER_SAMPLE)
        options["peak_flops_per_s"] = self.peak_flops_per_s
        if options.get("memory") not in (None, True, False):
            options["memory"] = DeviceMemoryOnly(options["memory"])
        return super().watch(model, optimizer, **options)


def job_scenario(
    config: JobConfig, hardware: str, noise_seed: int, steps: int, loss_every: int, eval_every: int
) -> Scenario:
    """The scenario that trains ``config`` for ``steps`` steps on ``hardware`` with this run's noise."""
    injector = JobAtCommit(config=config, noise_seed=noise_seed, peak_lr=config.lr)
    return Scenario(
        name="history",
        injector=injector,
        model=config.model,
        description="the history corpus' job",
        steps=steps,
        quick_steps=steps,
        batch=config.batch,
        lr=config.lr,
        step_time_s=HARDWARE[hardware]["step_time_s"],
        checkpoint_every=loss_every,
        checkpoint_s=3.0,
        eval_every=eval_every,
        eval_s=2.0,
        seed=config.seed,
        recorded=False,
    )


def with_changes(config: JobConfig, changes: dict[str, Any]) -> JobConfig:
    return replace(config, **changes)
