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
from runwatch.producer.instrument.heartbeat import HostLoadSampler
from runwatch.scenarios.clocks import HEARTBEAT_S
from runwatch.scenarios.faults import FaultInjector, FaultRun
from runwatch.scenarios.live import TrainingResult
from runwatch.scenarios.memory import HostSwings, ScenarioMemory
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
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=sc.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(sc, s, n))
    memory = ScenarioMemory(model)
    swings = HostSwings.for_scenario(sc.extra)  # host RSS that comes and goes around evals and checkpoints
    watch = rw.watch(
        model,
        optimizer,
        clip=1.0,
        update_every=5,
        heartbeat_s=HEARTBEAT_S,
        clock=clock.seconds if clock.simulated else None,
        memory=memory,
        # The corpus records faults as an unguarded trainer sees them (a sharded model, guard=False):
        # the detectors are measured on the fault itself, not on what the step guard leaves of it.
        guard=False,
        activations=True,  # every 5 steps (activations_every): the activations detector's samples
    )
    clock.bind(watch.heartbeat)
    host = SaturatedHost.for_scenario(sc)  # None unless the run shares a saturated host (heartbeats say so)
    if host is not None:
        watch.heartbeat.host_load = SimulatedHostLoad(host, clock)
    timing = random.Random(sc.seed * 31 + 7)
    val = task.validation(sc.extra.get("val_size", 256))
    eval_draws = random.Random(sc.seed * 53 + 11)  # used only where evals score a sample (eval_sample)
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

    def loader() -> Iterator[tuple[int, Batch]]:
        nonlocal next_step
        while next_step < n:
            step, next_step = next_step, next_step + 1
            clock.advance(_data_wait(sc, fault, timing, step))
            size = sc.batch * (sc.extra.get("batch_increase", 1) if step >= n // 2 else 1)
            batch = task.make_batch(_data_step(sc, step), size=size, length=fault.batch_length(step))
            yield step, fault.corrupt(task, batch, step)

    clock.advance(0.5)  # process start to first batch
    if clock.simulated:
        watch.heartbeat.beat()  # the first beat, before any step, as the thread would send it
    for step, batch in watch.data(loader()):
        optimizer = fault.optimizer(step, optimizer)  # (a fault may replace it: rw.watch is not told)
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
        swings.after_step(step)
        compute = fault.compute_time(sc.step_time_s * timing.lognormvariate(0, sc.noise), step)
        if host is not None and onset is not None and step >= onset:
            host.arrive(clock.seconds())  # the other jobs that come at the onset, where the host has them
        clock.advance(compute if host is None else host.stretch(compute, clock.seconds()))
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
            swings.at_checkpoint()
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
                scored = _eval_batch(sc, val, eval_draws)
                val_loss, cats_val = _evaluate(model, task, scored)
                swings.after_eval(step)
                clock.advance(sc.eval_s * timing.lognormvariate(0, 0.05))
            watch.eval(step, "val", val_loss, {"examples": float(scored.x.shape[0])}, per_category=cats_val)
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


def _data_wait(sc: Scenario, fault: FaultInjector, timing: random.Random, step: int) -> float:
    """How long ``step``'s batch keeps the loop waiting: the scenario's data wait as ``fault`` makes it, and
    now and then a hiccup (``hiccup_every``)."""
    wait = fault.data_wait(step, sc.data_wait_s * timing.lognormvariate(0, 0.3), timing)
    hiccup = sc.extra.get("hiccup_every")
    if hiccup and step > 0 and step % hiccup == 0:
        wait += 2.0 + 2.0 * timing.random()
    return wait


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


def _eval_batch(sc: Scenario, val: Batch, draws: random.Random) -> Batch:
    """What an eval scores: the whole validation set, or where the scenario has ``eval_sample``, a fresh
    random sample of that many of its examples (an eval on a few batches: a noisier validation loss)."""
    size = sc.extra.get("eval_sample")
    if not size:
        return val
    idx = torch.tensor(sorted(draws.sample(range(val.x.shape[0]), size)))
    return Batch(val.x[idx], val.y[idx], val.cat[idx])


def _evaluate(model: nn.Module, task: Task, val: Batch) -> tuple[float, Any]:
    with torch.no_grad():
        per_sample = task.per_sample_loss(model(val.x), val.y)
    return float(per_sample.mean()), category_loss(per_sample, val.cat, names=task.names)


@dataclass
class SaturatedHost:
    """A host shared with other jobs from start to end (``extra["saturated_host"]``: these fields): on
    ``cpus`` CPUs, ``others`` runnable tasks of other jobs on average, swinging by ``swing`` in waves of
    ``period_s`` (and a faster one a third as large). The run (one runnable thread) gets its fair share of
    the CPUs, ``min(1, cpus / (others + 1))``: its compute takes 1 / share as long, times a log-normal
    jitter of sigma ``jitter`` (the scheduler's ups and downs). What its heartbeats carry is what the real
    sampler would measure there: the 1-minute load average, the CPU count, no steal, and over the period
    this process's CPU share and, the rest of the time, its run-queue wait.

    More jobs may arrive at the fault's onset (:meth:`arrive`, from the onset step's compute on):
    ``others_after`` runnable tasks on average from then (the same waves), and ``slowdown_after``: the cache
    and memory-bandwidth contention they bring, which slows the run's compute by that factor on top of its
    smaller CPU share and which no CPU figure of its heartbeats shows. Without them (the default) the host
    is the same from start to end, and its draws are those of a host without arrivals."""

    cpus: int = 2
    others: float = 5.5
    swing: float = 1.0
    period_s: float = 90.0
    jitter: float = 0.2
    seed: int = 0
    others_after: float | None = None
    slowdown_after: float = 1.0
    arrived_at: float | None = field(default=None, init=False)  # the simulated second they came
    _rng: random.Random = field(init=False, repr=False)
    _phases: tuple[float, float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed * 97 + 5)  # its own draws: the run's timing draws are unchanged
        self._phases = (self._rng.uniform(0, 2 * math.pi), self._rng.uniform(0, 2 * math.pi))

    @classmethod
    def for_scenario(cls, sc: Scenario) -> SaturatedHost | None:
        options = sc.extra.get("saturated_host")
        return None if options is None else cls(**{"seed": sc.seed, **options})

    def arrive(self, t: float) -> None:
        """The onset: where the host has jobs that arrive (``others_after``, ``slowdown_after``), they come
        at simulated second ``t`` (the first call; later ones change nothing)."""
        if self.arrived_at is None and (self.others_after is not None or self.slowdown_after != 1.0):
            self.arrived_at = t

    def _arrived(self, t: float) -> bool:
        return self.arrived_at is not None and t >= self.arrived_at

    def others_at(self, t: float) -> float:
        """Runnable tasks of the other jobs at simulated second ``t``."""
        slow = math.sin(2 * math.pi * t / self.period_s + self._phases[0])
        fast = math.sin(2 * math.pi * t / (self.period_s / 4.3) + self._phases[1]) / 3
        level = self.others_after if self.others_after is not None and self._arrived(t) else self.others
        return max(0.0, level + self.swing * (slow + fast))

    def share_at(self, t: float) -> float:
        """The CPU share the run's thread gets at ``t``."""
        return min(1.0, self.cpus / (self.others_at(t) + 1))

    def stretch(self, seconds: float, t: float) -> float:
        """How long ``seconds`` of compute take at ``t`` on this host."""
        contended = self.slowdown_after if self._arrived(t) else 1.0  # (memory bandwidth: no CPU figure)
        return seconds * contended / self.share_at(t) * self._rng.lognormvariate(0, self.jitter)

    def mean_share(self, start: float, end: float) -> float:
        points = [start + (end - start) * (i + 0.5) / 10 for i in range(10)]
        return sum(self.share_at(t) for t in points) / len(points)

    def noisy(self, value: float) -> float:
        return round(max(0.0, value * self._rng.lognormvariate(0, 0.03)), 4)


class SimulatedHostLoad(HostLoadSampler):
    """The heartbeat's host-load sampler on a :class:`SaturatedHost` and the simulated clock: the load
    average follows the host's runnable tasks with a 1-minute time constant (the host was busy before the
    run began), the period shares are those of the period since the previous beat (none at the first)."""

    def __init__(self, host: SaturatedHost, clock: Any):
        super().__init__(clock=clock.seconds)
        self.host = host
        self.sim_clock = clock
        self._load = host.others + 1
        self._beat_at: float | None = None

    def sample(self) -> dict[str, Any] | None:
        host, now = self.host, self.sim_clock.seconds()
        out: dict[str, Any] = {"cpus": host.cpus}
        if self._beat_at is not None and now > self._beat_at:
            share = host.mean_share(self._beat_at, now)
            runnable = host.others_at(now) + 1
            self._load += (runnable - self._load) * (1 - math.exp(-(now - self._beat_at) / 60.0))
            out.update(
                steal_frac=0.0,
                process_cpu_frac=host.noisy(share),
                cpu_wait_frac=host.noisy(1 - share),
            )
        out["load1"] = round(self._load, 3)
        self._beat_at = now
        return out
