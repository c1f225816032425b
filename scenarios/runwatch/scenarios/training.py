"""Labelled training scenarios: real small PyTorch runs recorded as telemetry JSONL.

Training one scenario of the catalog for real. ``runwatch scenarios generate OUT_DIR`` (:mod:`.corpus`)
trains every recorded scenario on the CPU and writes ``OUT_DIR/<name>.jsonl`` (the wire events, in order) and
``OUT_DIR/labels.json`` (fault, onset, the module or category at fault, benign events).

What is real and what is simulated:

* Training is real: real models (MLP, CNN, transformer, the tiny audio model), real
  optimizers and schedulers, real losses, per-category losses, gradient and update norms
  measured by the real :class:`~runwatch.producer.instrument.watch.Watcher`. Faults are injected into
  the training itself (a corrupted batch, a bad LR, a gradient hook, corrupted labels of one
  category, tensors really retained every step, a tiny training set that really overfits).
* Wall time is simulated: every step advances a :class:`SimulatedClock` by a modelled step
  time (base + noise + the injected slowdown or data wait), and the Watcher times steps, data
  waits and phases on that clock, so step_time_s, data_wait_s, heartbeats and every ``ts``
  agree with one another. Minutes of training time take seconds to record; heartbeats go out
  every 5 simulated seconds, also through stalls and long checkpoint saves.
* Memory: ``host_rss`` (and cgroup figures) are sampled from this process. The CPU has no
  CUDA caching allocator, so ``allocated``/``reserved``/``peak`` come from
  :class:`CachingAllocatorModel`, driven by the sizes of the tensors the run really allocates
  (parameters, optimizer state, every module's activations, gradients, retained tensors).
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import torch
from torch import nn

from runwatch.producer import category_loss
from runwatch.scenarios.clocks import HEARTBEAT_S
from runwatch.scenarios.faults import FaultRun
from runwatch.scenarios.live import TrainingResult
from runwatch.scenarios.memory import ScenarioMemory
from runwatch.scenarios.scenario import Scenario
from runwatch.scenarios.tasks import Batch, Task, make_task
from runwatch.scenarios.threads import one_torch_thread


@dataclass
class ScenarioOutcome:
    steps: int  # step events published
    status: str  # for run_end
    onset_step: int | None
    onset_ts: datetime | None
    notes: dict[str, Any] = field(default_factory=dict)
    live: TrainingResult = field(default_factory=TrainingResult)  # the actions taken (with a listener)


def lr_factor(sc: Scenario, step: int, n: int) -> float:
    if sc.schedule == "constant":
        return 1.0
    if sc.schedule == "step_drop":
        return 1.0 if step < int(0.6 * n) else 0.1
    if sc.schedule == "warm_restarts":
        period = max(10, n // 3)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step % period) / period))
    warmup = min(sc.warmup, max(1, n // 5))
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, n - warmup)))


def run_scenario(
    sc: Scenario,
    rw: Any,
    clock: Any,
    *,
    quick: bool = False,
    on_step: Callable[[int, float], None] | None = None,
    listener: Any = None,
    on_action: Callable[[Any], None] | None = None,
) -> ScenarioOutcome:
    """Train ``sc`` for real, publishing through ``rw`` (a RunWatch or a JsonlRecorder).

    ``clock``: a :class:`SimulatedClock` (recording: simulated wall time, heartbeats beaten
    from it) or a :class:`WallClock` (a live demo: real time, the heartbeat thread beats).
    ``listener`` (an ActionListener, live runs): the actions are taken after every step, a
    rollback restoring the in-memory checkpoint it names. Does not close ``rw``; the outcome
    says which status its run_end should carry.
    """
    with one_torch_thread():  # tiny tensors: one thread is fastest and repeatable
        return _run(sc, rw, clock, quick, on_step, listener, on_action)


def _run(
    sc: Scenario,
    rw: Any,
    clock: Any,
    quick: bool,
    on_step: Callable[[int, float], None] | None,
    listener: Any,
    on_action: Callable[[Any], None] | None,
) -> ScenarioOutcome:
    n = sc.n_steps(quick)
    onset = sc.onset_step(quick)
    task = make_task(sc)
    model = task.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=sc.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(sc, s, n))
    memory = ScenarioMemory(model)
    watch = rw.watch(
        model,
        optimizer,
        clip=1.0,
        update_every=5,
        heartbeat_s=HEARTBEAT_S,
        clock=clock.seconds if clock.simulated else None,
        memory=memory,
    )
    clock.bind(watch.heartbeat)
    timing = random.Random(sc.seed * 31 + 7)
    val = task.validation(256)
    out = ScenarioOutcome(steps=0, status="completed", onset_step=onset, onset_ts=None)

    def mark_onset() -> None:
        if out.onset_ts is None:
            out.onset_ts = clock.now()

    fault = sc.injector.for_run()
    fault.start(
        FaultRun(
            onset=onset,
            steps=n,
            model=model,
            seed=sc.seed,
            step_time_s=sc.step_time_s,
            base_lr=lambda step: sc.lr * lr_factor(sc, step, n),
            mark_onset=mark_onset,
        )
    )
    checkpoints = _MemoryCheckpoints(model, optimizer, scheduler) if listener is not None else None
    if checkpoints is not None:
        listener.attach(model, optimizer, restore=checkpoints.restore, heartbeat=watch.heartbeat)
    best_val: tuple[float, int, datetime] | None = None
    next_step = 0  # a rollback moves it back

    def wait_for(step: int) -> float:
        wait = fault.data_wait(step, sc.data_wait_s * timing.lognormvariate(0, 0.3), timing)
        hiccup = sc.extra.get("hiccup_every")
        if hiccup and step > 0 and step % hiccup == 0:
            wait += 2.0 + 2.0 * timing.random()
        return wait

    def loader() -> Iterator[tuple[int, Batch]]:
        nonlocal next_step
        while next_step < n:
            step, next_step = next_step, next_step + 1
            clock.advance(wait_for(step))
            size = sc.batch * (sc.extra.get("batch_increase", 1) if step >= n // 2 else 1)
            batch = task.make_batch(_data_step(sc, step), size=size, length=fault.batch_length(step))
            yield step, fault.corrupt(task, batch, step)

    clock.advance(0.5)  # process start to first batch
    if clock.simulated:
        watch.heartbeat.beat()  # the first beat, before any step, as the thread would send it
    for step, batch in watch.data(loader()):
        fault.before_step(step, optimizer)
        logits = fault.forward(model, batch.x, step)
        per_sample = task.per_sample_loss(logits, batch.y)
        loss = fault.loss(per_sample.mean(), logits, step)
        backward_loss = fault.backward_loss(loss, per_sample, batch, step)
        optimizer.zero_grad(set_to_none=True)
        backward_loss.backward()  # type: ignore[no-untyped-call] # torch leaves Tensor.backward unannotated
        optimizer.step()
        scheduler.step()
        memory.after_step(fault.retain(model, batch, logits, step))
        clock.advance(fault.compute_time(sc.step_time_s * timing.lognormvariate(0, sc.noise), step))
        fault.step_computed(step)
        cats = category_loss(per_sample.detach(), batch.cat, names=task.names)
        watch.end_step(loss, step=step, samples=batch.x.shape[0], tokens=batch.tokens, category_loss=cats)
        out.steps += 1
        loss_value = float(loss.detach())
        out.live.step_executed(loss_value)
        if on_step is not None:
            on_step(step, loss_value)
        ended = fault.step_published(step, clock.advance)
        if ended is not None:
            out.status = ended
            break
        seconds = _checkpoint_seconds(sc, step, n)
        if seconds is not None:
            with watch.phase("checkpoint"):
                buffer = io.BytesIO()
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, buffer
                )
                clock.advance(seconds * timing.lognormvariate(0, 0.05))
            uri = f"mem://{sc.name}/step-{step:06d}.pt"
            if checkpoints is not None:
                checkpoints.keep(uri, buffer, step)
            rw.checkpoint(step, uri)
        if _eval_due(sc, step, n):
            with watch.phase("eval"):
                val_loss, cats_val = _evaluate(model, task, val)
                clock.advance(sc.eval_s * timing.lognormvariate(0, 0.05))
            watch.eval(step, "val", val_loss, {"examples": float(val.x.shape[0])}, per_category=cats_val)
            if _improves(val_loss, best_val):
                best_val = (val_loss, step, clock.now())
        if listener is not None:
            resumed_at = out.live.take(listener.poll(step), step, on_action)
            if out.live.stopped:
                out.status = "stopped"
                break
            if resumed_at != step:  # rolled back: train on from the restored checkpoint
                next_step = resumed_at + 1
    watch.close()
    out.live.steps_completed = next_step
    found_later = fault.onset_from_evals(best_val)
    if found_later is not None:
        out.onset_step, out.onset_ts, out.notes["best_val_loss"] = found_later
    out.notes["simulated_s"] = round(clock.seconds(), 1) if clock.simulated else None
    return out


class _MemoryCheckpoints:
    """A live run's checkpoints, kept in memory by URI, and the restore a rollback calls."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.saved: dict[str, tuple[bytes, int]] = {}

    def keep(self, uri: str, buffer: io.BytesIO, step: int) -> None:
        self.saved[uri] = (buffer.getvalue(), step)

    def restore(self, ref: Any) -> None:
        data, step = self.saved[ref.uri]
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.last_epoch = step + 1  # the schedule resumes where the checkpoint was taken


def _checkpoint_seconds(sc: Scenario, step: int, n: int) -> float | None:
    """The (simulated) seconds the checkpoint after ``step`` of ``n`` takes, or None when none is due:
    one every ``checkpoint_every`` steps, and half-way a ``long_checkpoint_s`` one where the scenario
    has it."""
    half_way = step + 1 == n // 2
    if not ((step + 1) % sc.checkpoint_every == 0 or (sc.extra.get("long_checkpoint_s") and half_way)):
        return None
    seconds: float = sc.extra.get("long_checkpoint_s", sc.checkpoint_s) if half_way else sc.checkpoint_s
    return seconds


def _eval_due(sc: Scenario, step: int, n: int) -> bool:
    """An evaluation after ``step`` of ``n``: every ``eval_every`` steps, and after the last."""
    return (step + 1) % sc.eval_every == 0 or step + 1 == n


def _improves(val_loss: float, best_val: tuple[float, int, datetime] | None) -> bool:
    """``val_loss`` is finite and below the best so far."""
    return math.isfinite(val_loss) and (best_val is None or val_loss < best_val[0])


def _data_step(sc: Scenario, step: int) -> int:
    epoch = sc.extra.get("epoch")
    return step % epoch if epoch else step  # a fixed order that repeats every epoch


def _evaluate(model: nn.Module, task: Task, val: Batch) -> tuple[float, Any]:
    with torch.no_grad():
        per_sample = task.per_sample_loss(model(val.x), val.y)
    return float(per_sample.mean()), category_loss(per_sample, val.cat, names=task.names)
