"""Labelled training scenarios: real small PyTorch runs recorded as telemetry JSONL.

``runwatch scenarios generate OUT_DIR`` trains every scenario of :data:`CATALOG` on the
CPU and writes ``OUT_DIR/<name>.jsonl`` (the wire events, in order) and
``OUT_DIR/labels.json`` (fault, onset, the module or category at fault, benign events).

What is real and what is simulated:

* Training is real: real models (MLP, CNN, transformer, the tiny audio model), real
  optimizers and schedulers, real losses, per-category losses, gradient and update norms
  measured by the real :class:`~runwatch.producer.watch.Watcher`. Faults are injected into
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
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runwatch.detectors import registry
from runwatch.producer.categories import category_loss
from runwatch.producer.gradstats import ROOT_MODULE
from runwatch.streams.scenario_clocks import HEARTBEAT_S, SimulatedClock
from runwatch.streams.scenario_memory import ScenarioMemory
from runwatch.streams.scenario_tasks import (
    Batch,
    Task,
    TinyTransformer,
    make_task,
)

# Which detector each fault kind is for: what every detector declares (detectors/registry.py).
DETECTOR_FOR = registry.detector_for_fault()
FAULT_TYPES = ("healthy", *DETECTOR_FOR)


# -- the catalog -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str
    model: str
    description: str
    steps: int = 300
    quick_steps: int = 100
    onset: float | None = None  # fraction of the steps; the onset step is computed from it
    batch: int = 64
    lr: float = 2e-3
    schedule: str = "warmup_cosine"  # constant | warmup_cosine | step_drop | warm_restarts
    warmup: int = 20
    step_time_s: float = 0.25
    data_wait_s: float = 0.01
    noise: float = 0.05
    checkpoint_every: int = 100
    checkpoint_s: float = 6.0
    eval_every: int = 50
    eval_s: float = 4.0
    module: str | None = None
    category: str | None = None
    kind: str | None = None
    magnitude: float | None = None
    benign: tuple[str, ...] = ()
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def n_steps(self, quick: bool) -> int:
        return self.quick_steps if quick else self.steps

    def onset_step(self, quick: bool) -> int | None:
        return None if self.onset is None else int(round(self.onset * self.n_steps(quick)))


CATALOG: tuple[Scenario, ...] = (
    # ---- faults ----
    Scenario("nan_loss_mlp", "non_finite", "mlp", "A log(0) in a custom loss term makes the loss NaN at the onset; "
             "the NaN gradients poison the weights and every later step is NaN.", onset=0.55, magnitude=float("nan")),
    Scenario("inf_input_transformer", "non_finite", "transformer", "A corrupted batch of embeddings overflows "
             "(x1e38): the loss is inf/NaN at the onset and the weights stay non-finite afterwards.",
             onset=0.6, step_time_s=0.4, seed=1, magnitude=1e38),
    Scenario("loss_spike_mlp", "loss_spike", "mlp", "One batch with every label shifted by one class (a corrupted "
             "shard): the loss spikes for that step, clipping keeps the weights sane.", onset=0.6, magnitude=1.0),
    Scenario("loss_spike_cnn", "loss_spike", "cnn", "One batch of images with inverted, x30 brightness and wrong "
             "labels: a loss spike for one step.", onset=0.5, seed=2, step_time_s=0.3, magnitude=30.0),
    Scenario("grad_spike_mlp", "grad_norm_spike", "mlp", "One step back-propagates the summed instead of the mean "
             "loss (a reduction bug): the gradient norm jumps by the batch size for that step, the logged loss "
             "is normal.", onset=0.55, seed=3, magnitude=64.0),
    Scenario("grad_spike_transformer", "grad_norm_spike", "transformer", "One step back-propagates the loss summed "
             "over all tokens (x batch*length): a gradient-norm spike, normal loss.", onset=0.5, seed=4,
             step_time_s=0.4, magnitude=512.0),
    Scenario("module_explosion_mlp", "module_grad_explosion", "mlp", "From the onset the gradient of encoder.2 "
             "grows by x1.15 per step (a hook multiplying it, as an unstable layer would), up to x1e4; the other "
             "modules stay normal.", onset=0.5, module="encoder.2", seed=5, magnitude=1.15),
    Scenario("module_explosion_transformer", "module_grad_explosion", "transformer", "From the onset the gradient "
             "of encoder.self_attn.out_proj grows by x1.25 per step up to x1e4.", onset=0.5,
             module="encoder.self_attn.out_proj", seed=6, step_time_s=0.4, magnitude=1.25),
    Scenario("bad_init_audio", "module_grad_explosion", "audio", "The field-notes mistake: a bare "
             "nn.Parameter(torch.randn(n_mels)) multiplied onto log-mel frames in dB. Present from step 0, owned "
             "by the root module ('(root)'): its gradient carries the dB magnitude (tens to hundreds of times the "
             "additive fix's, compare healthy_audio_fixed_init), yet it is not the largest module (conv1 is). "
             "A history-based detector cannot see it; a baseline comparison can.",
             onset=0.0, module=ROOT_MODULE, kind="bad_init", lr=1e-3, batch=16, step_time_s=0.3),
    Scenario("lr_too_large_mlp", "update_ratio", "mlp", "At the onset a resumed scheduler sets the LR x100: the "
             "relative update norm jumps out of its band.", onset=0.5, kind="too_large", seed=7, magnitude=100.0,
             schedule="constant", lr=1e-3),
    Scenario("lr_vanishing_cnn", "update_ratio", "cnn", "At the onset the LR collapses x1e-4 to 1e-7 (a schedule "
             "whose total steps were set too small): updates vanish, training silently stops.", onset=0.5,
             kind="vanishing", seed=8, magnitude=1e-4, schedule="constant", lr=1e-3, step_time_s=0.3),
    Scenario("throughput_halved_cnn", "throughput_drift", "cnn", "From the onset every step takes twice as long "
             "(a noisy neighbour takes half the machine): throughput halves and stays there.", onset=0.5,
             seed=9, step_time_s=0.3, magnitude=2.0),
    Scenario("throughput_creep_transformer", "throughput_drift", "transformer", "From the onset the step time "
             "creeps up linearly to +80% by the end of the run (a growing host-side cost).", onset=0.4, seed=10,
             step_time_s=0.4, magnitude=1.8),
    Scenario("data_wait_growing_mlp", "data_wait", "mlp", "From the onset the data loader falls behind: the wait "
             "per batch grows linearly to 3x the compute time (workers dying one by one).", onset=0.5, seed=11,
             step_time_s=0.2, magnitude=3.0),
    Scenario("data_wait_jump_transformer", "data_wait", "transformer", "At the onset the data moves to a slow "
             "remote store: the wait per batch jumps to 0.6 s against 0.4 s of compute.", onset=0.55, seed=12,
             step_time_s=0.4, magnitude=0.6),
    Scenario("memory_leak_mlp", "memory_leak", "mlp", "From the onset a debugging hook keeps every step's "
             "activations in a list that is never cleared: real tensors really retained (host RSS grows), "
             "about 110 KB per step, gradual. allocated/reserved come from the documented caching-allocator "
             "model (CPU run) and grow by exactly the retained bytes.", onset=0.4, seed=13, kind="leak",
             steps=400, quick_steps=120),
    Scenario("memory_fragmentation_transformer", "memory_fragmentation", "transformer", "From the onset batches "
             "have a variable sequence length (16..256, padding removed). allocated/reserved are EMULATED by the "
             "documented caching-allocator model (CPU run: no CUDA allocator) from the real activation sizes: "
             "cached blocks of earlier lengths are the wrong size, so reserved - allocated grows while allocated "
             "stays level.", onset=0.3, seed=14, kind="fragmentation", batch=16, step_time_s=0.4, steps=400,
             quick_steps=120),
    Scenario("category_divergence_mlp", "category_divergence", "mlp", "From the onset a growing share of the "
             "labels of category 'sv' (4% of the data) come from a broken pipeline (a fixed permutation of the "
             "classes), up to 30% of that category after 100 steps: its loss rises while the mean loss barely "
             "moves.", onset=0.5, category="sv", seed=15, steps=400, quick_steps=300, magnitude=0.3),
    Scenario("category_divergence_cnn", "category_divergence", "cnn", "From the onset a growing share (up to "
             "60% after 100 steps) of the images of source 'pt' (8% of the data) carry wrong labels (a fixed "
             "permutation): its loss rises while the mean stays close.", onset=0.5, category="pt", seed=16,
             step_time_s=0.3, magnitude=0.6, quick_steps=300),
    Scenario("overfit_val_mlp", "val_vs_train", "mlp", "Training on 192 samples with 20% label noise: the "
             "training loss keeps falling while the validation loss turns up (real overfitting). The onset is "
             "the eval step with the best validation loss.", seed=17, steps=600, quick_steps=300,
             eval_every=20, extra={"train_size": 192, "label_noise": 0.2}, lr=5e-4, schedule="constant"),
    Scenario("stall_hang_train", "stall", "mlp", "At the onset the rank hangs in the training phase (a collective "
             "that never returns): heartbeats go on for 180 s in phase 'train', the step does not move, then the "
             "job is killed (run_end 'interrupted'). onset_step is the last completed step.", onset=0.7, seed=18,
             kind="train", magnitude=180.0),
    Scenario("stall_dataload_hang", "stall", "cnn", "At the onset the data loader hangs for 300 s (phase "
             "'dataload', past its allowance), then recovers. onset_step is the last completed step.", onset=0.6,
             seed=19, kind="dataload", step_time_s=0.3, magnitude=300.0),
    # ---- healthy, with the benign events naive detectors mistake for faults ----
    Scenario("healthy_mlp_warmup_cosine", "healthy", "mlp", "Warm-up to the LR peak, cosine decay, checkpoints "
             "and evals.", seed=20, warmup=40, benign=("lr_warmup_peak", "checkpoint", "eval")),
    Scenario("healthy_mlp_planned_lr_drop", "healthy", "mlp", "Constant LR with a planned x0.1 drop at 60% (the "
             "update ratio drops tenfold, by design).", seed=21, schedule="step_drop", lr=2e-3,
             benign=("planned_lr_drop", "checkpoint", "eval")),
    Scenario("healthy_cnn_epoch_boundaries", "healthy", "cnn", "Epochs of 50 steps in a fixed order whose first "
             "batches are the noisiest: the loss bumps at every epoch boundary.", seed=22, step_time_s=0.3,
             extra={"epoch": 50}, benign=("epoch_boundary_loss_bump", "lr_warmup_peak", "checkpoint", "eval")),
    Scenario("healthy_transformer_long_checkpoint", "healthy", "transformer", "A long checkpoint save of 240 s "
             "(phase 'checkpoint') half way: heartbeats go on, the step does not move, and that is not a stall.",
             seed=23, step_time_s=0.4, extra={"long_checkpoint_s": 240.0},
             benign=("long_checkpoint", "lr_warmup_peak", "checkpoint", "eval")),
    Scenario("healthy_small_batch_noisy", "healthy", "mlp", "Batches of 4: a noisy, heavy-tailed loss and grad "
             "norm, no fault.", seed=24, batch=4, lr=5e-4, step_time_s=0.05,
             benign=("noisy_small_batch_loss", "lr_warmup_peak", "checkpoint", "eval")),
    Scenario("healthy_audio_fixed_init", "healthy", "audio_fixed", "The additive LearnableBias fix of "
             "bad_init_audio, same seed and schedule.", lr=1e-3, batch=16, step_time_s=0.3,
             benign=("lr_warmup_peak", "checkpoint", "eval")),
    Scenario("healthy_frequent_evals", "healthy", "transformer", "Evals every 20 steps that take 60 s each and a "
             "checkpoint every 40 steps: long off-step phases, heartbeats say 'eval'.", seed=25, step_time_s=0.4,
             eval_every=20, eval_s=60.0, checkpoint_every=40, benign=("periodic_eval", "checkpoint",
                                                                      "lr_warmup_peak")),
    Scenario("healthy_data_hiccups", "healthy", "cnn", "Now and then one batch waits 2-4 s (a storage hiccup, a "
             "GC pause): single slow steps, no drift.", seed=26, step_time_s=0.3, extra={"hiccup_every": 37},
             benign=("single_slow_steps", "lr_warmup_peak", "checkpoint", "eval")),
    Scenario("healthy_warm_restarts", "healthy", "mlp", "Cosine annealing with warm restarts every 100 steps: the "
             "LR jumps back to its peak and the loss bumps, by design.", seed=27, schedule="warm_restarts",
             benign=("lr_restart", "checkpoint", "eval")),
    Scenario("healthy_rare_category", "healthy", "transformer", "Categories of very different sizes: the rarest "
             "has 4% of the data and a noisy per-step loss.", seed=28, step_time_s=0.4, batch=32,
             benign=("rare_category_noise", "lr_warmup_peak", "checkpoint", "eval")),
    Scenario("healthy_eval_memory_step", "healthy", "mlp", "An eval with a 4x larger batch under no_grad and a "
             "larger training batch after a planned batch-size increase at 50%: memory steps up once, then is "
             "flat.", seed=29, extra={"batch_increase": 2}, benign=("memory_step_up", "lr_warmup_peak",
                                                                   "checkpoint", "eval")),
)
SCENARIOS = {s.name: s for s in CATALOG}
FAULT_SCENARIOS: tuple[str, ...] = tuple(s.name for s in CATALOG if s.fault != "healthy")
HEALTHY_SCENARIOS: tuple[str, ...] = tuple(s.name for s in CATALOG if s.fault == "healthy")


# -- running one scenario ---------------------------------------------------------------------------------


@dataclass
class ScenarioOutcome:
    steps: int  # step events published
    status: str  # for run_end
    onset_step: int | None
    onset_ts: datetime | None
    notes: dict[str, Any] = field(default_factory=dict)


def _lr_factor(sc: Scenario, step: int, n: int) -> float:
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


def run_scenario(sc: Scenario, rw: Any, clock: Any, *, quick: bool = False,
                 on_step: Callable[[int, float], None] | None = None) -> ScenarioOutcome:
    """Train ``sc`` for real, publishing through ``rw`` (a RunWatch or a JsonlRecorder).

    ``clock``: a :class:`SimulatedClock` (recording: simulated wall time, heartbeats beaten
    from it) or a :class:`WallClock` (a live demo: real time, the heartbeat thread beats).
    Does not close ``rw``; the outcome says which status its run_end should carry.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest and repeatable
    try:
        return _run(sc, rw, clock, quick, on_step)
    finally:
        torch.set_num_threads(threads)


def _run(sc: Scenario, rw: Any, clock: Any, quick: bool,
         on_step: Callable[[int, float], None] | None) -> ScenarioOutcome:
    n = sc.n_steps(quick)
    onset = sc.onset_step(quick)
    task = make_task(sc)
    model = task.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=sc.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(sc, s, n))
    memory = ScenarioMemory(model)
    watch = rw.watch(model, optimizer, clip=1.0, update_every=5, heartbeat_s=HEARTBEAT_S,
                     clock=clock.seconds if clock.simulated else None, memory=memory)
    clock.bind(watch.heartbeat)
    timing = random.Random(sc.seed * 31 + 7)
    val = task.validation(256)
    fault = sc.fault
    out = ScenarioOutcome(steps=0, status="completed", onset_step=onset, onset_ts=None)
    retained: list[torch.Tensor] = []
    multiplier = [1.0]
    if fault == "module_grad_explosion" and sc.kind != "bad_init":
        target = dict(model.named_modules())[sc.module]
        for p in target.parameters(recurse=False):
            p.register_hook(lambda g: g * multiplier[0])
    best_val: tuple[float, int, datetime] | None = None
    frag_gen = random.Random(sc.seed)
    stop_after: int | None = None

    def mark_onset() -> None:
        if out.onset_ts is None:
            out.onset_ts = clock.now()

    def wait_for(step: int) -> float:
        wait = sc.data_wait_s * timing.lognormvariate(0, 0.3)
        if fault == "data_wait" and onset is not None and step >= onset:
            if sc.name.endswith("jump_transformer"):
                wait = sc.magnitude * timing.lognormvariate(0, 0.1)
            else:
                wait += sc.magnitude * sc.step_time_s * (step - onset + 1) / max(1, n - onset)
        if fault == "stall" and sc.kind == "dataload" and step == (onset or 0) + 1:
            mark_onset()
            wait += sc.magnitude
        hiccup = sc.extra.get("hiccup_every")
        if hiccup and step > 0 and step % hiccup == 0:
            wait += 2.0 + 2.0 * timing.random()
        return wait

    def loader() -> Iterator[tuple[int, Batch]]:
        for step in range(n):
            clock.advance(wait_for(step))
            size = sc.batch * (sc.extra.get("batch_increase", 1) if step >= n // 2 else 1)
            length = None
            if fault == "memory_fragmentation" and onset is not None and step >= onset:
                length = frag_gen.randint(16, 256)
            batch = task.make_batch(_data_step(sc, step), size=size, length=length)
            yield step, _corrupt(sc, task, batch, step, onset)

    def compute_time(step: int) -> float:
        t = sc.step_time_s * timing.lognormvariate(0, sc.noise)
        if fault == "throughput_drift" and onset is not None and step >= onset:
            if sc.name.startswith("throughput_halved"):
                t *= sc.magnitude
            else:
                t *= 1 + (sc.magnitude - 1) * (step - onset + 1) / max(1, n - onset)
        return t

    clock.advance(0.5)  # process start to first batch
    if clock.simulated:
        watch.heartbeat.beat()  # the first beat, before any step, as the thread would send it
    for step, batch in watch.data(loader()):
        at_onset = onset is not None and step == onset
        if onset is not None and step >= onset and fault in ("update_ratio",):
            scale = sc.magnitude
            for g in optimizer.param_groups:
                g["lr"] = sc.lr * _lr_factor(sc, step, n) * scale
        if fault == "module_grad_explosion" and onset is not None and step >= onset and sc.kind != "bad_init":
            multiplier[0] = min(1e4, sc.magnitude ** (step - onset + 1))
        logits = _forward(model, batch.x, scale=sc.magnitude if (fault == "non_finite" and sc.model == "transformer"
                                                         and at_onset) else None)
        per_sample = task.per_sample_loss(logits, batch.y)
        loss = per_sample.mean()
        if fault == "non_finite" and sc.model == "mlp" and at_onset:
            loss = loss + 0.0 * torch.log(logits.abs().min() * 0.0)  # log(0) * 0: NaN, and NaN gradients
        backward_loss = loss
        if fault == "grad_norm_spike" and at_onset:
            backward_loss = per_sample.sum() if sc.model == "mlp" else loss * (batch.x.numel())
        optimizer.zero_grad(set_to_none=True)
        backward_loss.backward()
        optimizer.step()
        scheduler.step()
        retained_bytes: list[int] = []
        if fault == "memory_leak" and onset is not None and step >= onset:
            with torch.no_grad():
                h1 = model.encoder[0](batch.x)
                kept = [batch.x.clone(), h1, F.gelu(h1), model.encoder(batch.x), logits.detach().clone()]
            retained.extend(kept)  # the bug: a list that is never cleared
            retained_bytes = [t.numel() * t.element_size() for t in kept]
        memory.after_step(retained_bytes)
        clock.advance(compute_time(step))
        if at_onset and fault not in ("stall",):
            mark_onset()
        cats = category_loss(per_sample.detach(), batch.cat, names=task.names)
        watch.end_step(loss, step=step, samples=batch.x.shape[0], tokens=batch.tokens, category_loss=cats)
        out.steps += 1
        if on_step is not None:
            on_step(step, float(loss.detach()))
        if fault == "stall" and sc.kind == "train" and at_onset:
            mark_onset()
            clock.advance(sc.magnitude)  # hung: the heartbeats go on, no step completes
            out.status = "interrupted"
            stop_after = step
        if stop_after is not None:
            break
        if (step + 1) % sc.checkpoint_every == 0 or (sc.extra.get("long_checkpoint_s") and step + 1 == n // 2):
            seconds = sc.extra.get("long_checkpoint_s", sc.checkpoint_s) if step + 1 == n // 2 else sc.checkpoint_s
            with watch.phase("checkpoint"):
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, buffer)
                clock.advance(seconds * timing.lognormvariate(0, 0.05))
            rw.checkpoint(step, f"mem://{sc.name}/step-{step:06d}.pt")
        if (step + 1) % sc.eval_every == 0 or step + 1 == n:
            with watch.phase("eval"):
                val_loss, cats_val = _evaluate(model, task, val)
                clock.advance(sc.eval_s * timing.lognormvariate(0, 0.05))
            watch.eval(step, "val", val_loss, {"examples": float(val.x.shape[0])}, per_category=cats_val)
            if math.isfinite(val_loss) and (best_val is None or val_loss < best_val[0]):
                best_val = (val_loss, step, clock.now())
    watch.close()
    if fault == "val_vs_train" and best_val is not None:
        out.onset_step, out.onset_ts = best_val[1], best_val[2]
        out.notes["best_val_loss"] = best_val[0]
    if fault == "stall":
        out.onset_step = onset
    out.notes["simulated_s"] = round(clock.seconds(), 1) if clock.simulated else None
    return out


def _data_step(sc: Scenario, step: int) -> int:
    epoch = sc.extra.get("epoch")
    return step % epoch if epoch else step  # a fixed order that repeats every epoch


def _corrupt(sc: Scenario, task: Task, batch: Batch, step: int, onset: int | None) -> Batch:
    if onset is None:
        return batch
    if sc.fault == "loss_spike" and step == onset:
        if sc.model == "cnn":
            return Batch(-sc.magnitude * batch.x, (batch.y + 3) % 8, batch.cat)
        return Batch(batch.x, (batch.y + 1) % 10, batch.cat)
    if sc.fault == "category_divergence" and step >= onset:
        hit = batch.cat == task.names.index(sc.category)
        ramp = min(1.0, (step - onset + 1) / 100)  # the broken share of that category grows over 100 steps
        g = torch.Generator().manual_seed(step)
        hit &= torch.rand(hit.shape, generator=g) < sc.magnitude * ramp
        classes = 10 if sc.model == "mlp" else 8
        wrong = (3 * batch.y + 1) % classes  # a fixed permutation of the classes with no fixed point
        return Batch(batch.x, torch.where(hit, wrong, batch.y), batch.cat)
    return batch


def _forward(model: nn.Module, x: torch.Tensor, scale: float | None) -> torch.Tensor:
    if scale is None or not isinstance(model, TinyTransformer):
        return model(x)
    # The corrupted batch: embeddings overflow to inf before the encoder.
    n = x.shape[1]
    h = (model.embed(x) + model.pos(torch.arange(n))) * scale * 1e3
    mask = nn.Transformer.generate_square_subsequent_mask(n)
    return model.head(model.norm(model.encoder(h, src_mask=mask, is_causal=True)))


def _evaluate(model: nn.Module, task: Task, val: Batch) -> tuple[float, Any]:
    with torch.no_grad():
        per_sample = task.per_sample_loss(model(val.x), val.y)
    return float(per_sample.mean()), category_loss(per_sample, val.cat, names=task.names)


# -- generating the files -------------------------------------------------------------------------------


def label_for(sc: Scenario, outcome: ScenarioOutcome) -> dict[str, Any]:
    label: dict[str, Any] = {
        "name": sc.name,
        "fault": sc.fault,
        "expected_detector": DETECTOR_FOR.get(sc.fault),
        "onset_step": outcome.onset_step,
        "onset_ts": outcome.onset_ts.isoformat() if outcome.onset_ts else None,
        "model": sc.model,
        "steps": outcome.steps,
        "status": outcome.status,
        "description": sc.description,
        "benign": list(sc.benign),
        "seed": sc.seed,
    }
    for key in ("module", "category", "kind"):
        value = getattr(sc, key)
        if value is not None:
            label[key] = value
    if sc.fault == "stall":  # the scenario's kind is the phase it hangs in; the finding's kind is "stalled"
        label["phase"] = label.pop("kind")
        label["kind"] = "stalled"
    if sc.magnitude is not None:
        label["magnitude"] = sc.magnitude if math.isfinite(sc.magnitude) else str(sc.magnitude)
    label.update({k: v for k, v in outcome.notes.items() if v is not None})
    return label


def generate(out_dir: Any, names: list[str] | None = None, *, quick: bool = False,
             progress: Callable[[str, dict[str, Any], float], None] | None = None) -> list[dict[str, Any]]:
    """Record the chosen scenarios (default: all) into ``out_dir``; returns the labels written."""
    from pathlib import Path

    from runwatch.producer.recorder import JsonlRecorder

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [SCENARIOS[n] for n in names] if names else list(CATALOG)
    labels = []
    for sc in chosen:
        started = time.perf_counter()
        clock = SimulatedClock()
        rec = JsonlRecorder(out / f"{sc.name}.jsonl", f"scenario-{sc.name}", clock=clock.now,
                            collect_metadata=False, seed=sc.seed, config=_config(sc, quick),
                            tags={"scenario": sc.name, "fault": sc.fault, "model": sc.model,
                                  "memory_model": "emulated-caching-allocator"},
                            baseline_key=f"scenarios/{sc.model}")
        outcome = run_scenario(sc, rec, clock, quick=quick)
        rec.close(status=outcome.status, summary={"steps": outcome.steps})
        label = label_for(sc, outcome)
        labels.append(label)
        if progress is not None:
            progress(sc.name, label, time.perf_counter() - started)
    import json

    (out / "labels.json").write_text(json.dumps(labels, indent=2) + "\n")
    return labels


def _config(sc: Scenario, quick: bool) -> dict[str, Any]:
    config = {k: v for k, v in asdict(sc).items() if k not in ("description", "benign")}
    config["steps"] = sc.n_steps(quick)
    if config.get("magnitude") is not None and not math.isfinite(config["magnitude"]):
        config["magnitude"] = str(config["magnitude"])
    return config
