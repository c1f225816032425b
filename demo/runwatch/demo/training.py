"""The demo's regressor: a real, small PyTorch training run with a catalog fault injected at a known step.

The model is a small MLP regressor on data generated locally from a fixed teacher
network; batches are a pure function of the step, so a rollback replays the same data.
Faults fire once (the first time their step is reached), as a corrupted batch would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from runwatch.producer import ActionListener, AppliedAction, RunWatch, category_loss, save_checkpoint
from runwatch.scenarios.catalog import SCENARIOS
from runwatch.scenarios.faults import FaultRun, Healthy
from runwatch.scenarios.live import TrainingResult
from runwatch.scenarios.scenario import Scenario
from runwatch.scenarios.tasks import Batch
from runwatch.scenarios.threads import one_torch_thread


@dataclass
class TrainingConfig:
    scenario: Scenario = SCENARIOS["healthy"]  # a catalog scenario of the regressor
    steps: int = 300
    fault_step: int | None = None
    checkpoint_every: int = 25
    step_interval_s: float = 0.02  # pace steps like a real (slower) model would
    batch_size: int = 32
    lr: float = 1e-3
    clip: float = 1.0
    seed: int = 0
    checkpoint_dir: Path = Path(".runwatch/checkpoints")
    # A stall: the first time this step is reached, it hangs for stall_s in the train phase (heartbeats go
    # on, the step does not move), as a slow collective or a stuck file system would (issue 39's goodput demo)
    stall_step: int | None = None
    stall_s: float = 15.0


def default_fault_step(steps: int) -> int:
    return max(30, steps // 2 + 3)  # after warm-up, off the checkpoint grid


class DemoModel(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 128):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(x))
        return out.squeeze(-1)


def make_batch(
    teacher: nn.Module, step: int, batch_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(batch_size, 32, generator=g)
    with torch.no_grad():
        y = teacher(x) + 0.05 * torch.randn(batch_size, generator=g)
    return x, y


def train(
    cfg: TrainingConfig,
    rw: RunWatch,
    listener: ActionListener | None,
    on_step: Callable[[int, float], None] | None = None,
    on_action: Callable[[AppliedAction], None] | None = None,
) -> TrainingResult:
    # Tiny tensors: one thread is fastest, and steady on a busy machine. With torch's default (a
    # thread per core) and two CPU-bound processes beside the demo, a 3 ms step took 40-60 ms at
    # its 90th percentile and up to 200 ms, a real slowdown that throughput_drift then reported.
    with one_torch_thread():
        return _train(cfg, rw, listener, on_step, on_action)


def _train(
    cfg: TrainingConfig,
    rw: RunWatch,
    listener: ActionListener | None,
    on_step: Callable[[int, float], None] | None,
    on_action: Callable[[AppliedAction], None] | None,
) -> TrainingResult:
    if cfg.scenario.model != "regressor":
        raise ValueError(f"{cfg.scenario.name!r} is not a scenario of the demo's regressor")
    torch.manual_seed(cfg.seed)
    teacher = DemoModel()
    model = DemoModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    if listener is not None:
        listener.attach(model, optimizer)
    ckpt_dir = Path(cfg.checkpoint_dir) / rw.run_id
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # runwatch clips (replacing clip_grad_norm_) and measures around optimizer.step()
    watch = rw.watch(model, optimizer, clip=cfg.clip, update_every=10, heartbeat_s=1.0)

    def checkpoint(step: int) -> None:
        path = ckpt_dir / f"step-{step:06d}.pt"
        with watch.phase("checkpoint"):
            save_checkpoint(str(path), model, optimizer, step=step)
        rw.checkpoint(step, str(path))

    fault = cfg.scenario.injector.for_run()
    fault.start(FaultRun(onset=cfg.fault_step, steps=cfg.steps, model=model, seed=cfg.seed))
    after_fault = Healthy()  # the fault fires once: a replay after a rollback is clean
    after_fault.start(FaultRun(onset=None, steps=cfg.steps, model=model, seed=cfg.seed))
    result = TrainingResult()
    fired = False
    stalled = False
    checkpoint(0)
    step = 0
    while step < cfg.steps:
        step += 1
        started = time.perf_counter()
        injector = after_fault if fired else fault
        fired = fired or step == cfg.fault_step
        x, y = make_batch(teacher, step, cfg.batch_size, cfg.seed)
        batch = injector.corrupt(None, Batch(x, y, (x[:, 0] > 0).long()), step)
        out = injector.forward(model, batch.x, step)
        per_sample = (out - batch.y) ** 2
        loss = injector.loss(per_sample.mean(), out, step)
        optimizer.zero_grad(set_to_none=True)
        # (torch leaves Tensor.backward unannotated)
        injector.backward_loss(loss, per_sample, batch, step).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if step == cfg.stall_step and not stalled:
            stalled = True
            time.sleep(cfg.stall_s)
        loss_value = float(loss.detach())
        result.step_executed(loss_value)
        # two data categories (by the sign of the first feature), to show per-category loss
        categories = category_loss(per_sample.detach(), batch.cat, names=["neg", "pos"])
        watch.end_step(loss, step=step, samples=cfg.batch_size, category_loss=categories)
        elapsed = time.perf_counter() - started
        if on_step is not None:
            on_step(step, loss_value)
        if step % cfg.checkpoint_every == 0 and math.isfinite(loss_value):
            checkpoint(step)
        if cfg.step_interval_s > elapsed:
            time.sleep(cfg.step_interval_s - elapsed)
        if listener is None:
            continue
        step = result.take(listener.poll(step), step, on_action)
        if result.stopped:
            break
    watch.close()
    result.steps_completed = step
    return result
