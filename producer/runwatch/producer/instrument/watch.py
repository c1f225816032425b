"""``Watcher``: fills every step event from the model, the optimizer and the clock.

Plain loop::

    watch = rw.watch(model, optimizer, clip=1.0)       # replaces clip_grad_norm_
    for batch in watch.data(loader):
        loss = model(batch).mean()
        loss.backward()
        optimizer.step()                                # hooks measure and clip around it
        optimizer.zero_grad()
        watch.end_step(loss, samples=len(batch))

A hand-written update, with no ``torch.optim`` optimizer (``optimizer=None``): call the two
hooks yourself around the update, and give the LR (here or per step to ``end_step``)::

    watch = rw.watch(model, None, lr=0.1)
    for batch in watch.data(loader):
        model.zero_grad()
        loss = model(batch).mean()
        loss.backward()
        watch.before_optimizer_step()                   # gradient norms (and clip=, if given)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        watch.after_optimizer_step()                    # parameter and update norms
        watch.end_step(loss, lr=0.1)

Without those two calls the step event still carries the loss, the timings and the norms of
the gradients present at ``end_step`` (none if they were zeroed or set to None after the
update), but no update norms, and ``clip=`` cannot clip.

Cost model: gradient norms (global and per module) every step from one fused norm
over the gradients, which clipping needs anyway; parameter and update norms every
``update_every`` steps from a device copy of the weights kept across that one step.
All figures of a step travel to the host in one small copy; on CUDA that copy is
asynchronous and read one step later, so the GPU is never made to wait.

Several ranks:

- ``DistributedDataParallel``: when ``model`` is the DDP wrapper, a comm hook times each
  step's gradient synchronisation (:mod:`runwatch.producer.instrument.ddp_timing`): step events carry
  ``compute_s`` (this rank's own work, without the wait for slower peers) and heartbeats
  ``in_sync`` (waiting for peers right now). ``sync_timing=False`` turns it off.
- Sharded parameters (ZeRO, FSDP with whole parameters per rank): ``shard=`` names the
  parameters this rank owns (names or a ``(name, param) -> bool`` predicate). Only those are
  measured and step events say ``grad_sharded=True``; the worker joins the ranks' norms by the
  root of the sum of squares. runwatch cannot clip a shard (the factor needs the global norm),
  so ``clip=`` is refused: clip with the framework (``model.clip_grad_norm_``) and pass
  ``external_clip``. Clip ratio, clipped norm and the update ratios need the global figures too:
  they are left to the worker's join.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from runwatch.producer.instrument.activations import ActivationProbe
from runwatch.producer.instrument.categories import CategoryLossBatch, per_category_metrics
from runwatch.producer.instrument.ddp_timing import is_ddp
from runwatch.producer.instrument.fingerprint import DIGEST_VALUES, ReplicaFingerprint
from runwatch.producer.instrument.gradstats import (
    GradNorms,
    HostGradNorms,
    ParamLayout,
    ShardSpec,
    UpdateNorms,
    UpdateProbe,
    grad_norms,
    host_grad_norms,
)
from runwatch.producer.instrument.guard import GuardOptions, SkipReason
from runwatch.producer.instrument.heartbeat import DEFAULT_STACKS_AFTER_S, Heartbeat
from runwatch.producer.instrument.off_step import OFF_STEP_PHASES, OffStepTime
from runwatch.producer.instrument.optimizer_stepping import OptimizerStepping, backward_marker
from runwatch.producer.instrument.pending_steps import PendingStep, PendingSteps
from runwatch.producer.instrument.runtime import StepClock, mfu, peak_flops, transformer_flops_per_step
from runwatch.producer.instrument.step_packing import StepPacking
from runwatch.producer.instrument.update_guard import UpdateGuard
from runwatch.producer.instrument.watch_options import (
    check_options,
    ddp_sync_timer,
    gpu_source,
    lr_list,
    memory_source,
    step_guard,
)
from runwatch.producer.publish.lr_hold import LRHold

if TYPE_CHECKING:
    import torch

    from runwatch.producer.publish.publisher import Publisher

log = logging.getLogger(__name__)

# Memory is a slow signal: one sample per this many seconds serves the leak and fragmentation detectors
# as well as one per step, for a fraction of the host time on a loop of 10 ms steps.
MEMORY_INTERVAL_S = 0.1


class Watcher:
    """Instruments one model and optimizer for one rank; publishes through ``rw``.

    ``memory``: True samples this process (:class:`MemorySampler`), False turns memory off, or
    any object with ``sample() -> MemoryStats | None``. ``clock``: seconds for step time, data
    wait, off-step phases and the heartbeat's time in phase (default: the wall clock). With a
    ``clock`` of its own the heartbeat thread is not started, since its interval is wall time:
    the caller calls ``watch.heartbeat.beat()`` when that clock says so (a simulated run does).

    ``optimizer=None``: a hand-written update (see the module doc); no hooks are installed, the
    caller calls :meth:`before_optimizer_step` and :meth:`after_optimizer_step` around the update.
    ``lr``: the learning rate (one per param group) step events report when there is no optimizer
    to read it from; ``end_step(lr=...)`` gives it for one step.

    ``shard``: the parameters this rank owns in a sharded model (see the module doc); with it,
    ``clip`` is refused. ``sync_timing``: time DDP's gradient sync when ``model`` is a
    ``DistributedDataParallel`` (registers a comm hook; see :mod:`runwatch.producer.instrument.ddp_timing`).

    ``replicas``: whether the ranks hold the same parameters (None: when ``model`` is a
    ``DistributedDataParallel`` and not ``shard``); then every ``fingerprint_every`` steps (50; 0: never)
    the step event carries ``param_digest``, an exact digest of the parameters' bits that the worker
    compares across the replicas (:mod:`runwatch.producer.instrument.fingerprint`).

    ``activations``: forward hooks on the model's leaf modules, armed every ``activations_every`` steps,
    put each module's output RMS and zero fraction in ``module_activations``
    (:mod:`runwatch.producer.instrument.activations`). Off by default: on a small model its Python costs
    a few percent of a step at every 5 steps (docs/producer.md has the measured cost).

    ``stacks_after_s``: when the last step has not moved for this long (train or dataload phase), the
    heartbeat thread publishes the Python stack of every thread once (an ``evidence`` event the worker
    attaches to its ``hung_rank`` and ``stall`` findings; instrument/stacks.py). Nothing on the per-step
    path; None or 0 turns it off.

    ``gpu_health``: True (the default) gives the heartbeats of a CUDA model ``gpu``, NVML's figures for its
    device, where nvidia-ml-py is installed (the ``gpu`` extra;
    :mod:`runwatch.producer.instrument.gpu_health`), sampled on the heartbeat thread at most once a
    second; none on a CPU model or with a ``clock`` of the caller's. False: never.
    An object with ``sample()`` (a ``GpuHealthSampler`` given its ``nvml``): that.
    """

    def __init__(
        self,
        rw: Publisher,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        lr: float | Sequence[float] | None = None,
        clip: float | None = None,
        update_every: int = 10,
        module_norms: bool = True,
        hooks: bool = True,
        external_clip: float | None = None,
        heartbeat_s: float | None = 5.0,
        flops_per_step: float | None = None,
        peak_flops_per_s: float | None = None,
        memory: bool | Any = True,
        first_step: int = 0,
        clock: Callable[[], float] | None = None,
        shard: ShardSpec | None = None,
        sync_timing: bool = True,
        guard: bool | GuardOptions = True,
        activations: bool = False,
        activations_every: int = 5,
        replicas: bool | None = None,
        fingerprint_every: int = 50,
        stacks_after_s: float | None = DEFAULT_STACKS_AFTER_S,
        gpu_health: bool | Any = True,
    ):
        check_options(clip, external_clip, update_every, shard)
        if activations_every < 1:
            raise ValueError(f"activations_every must be >= 1, got {activations_every}")
        self.rw = rw
        # Step events through rw.queue_step where rw has it (validated off the training thread), else rw.step
        queue_step = getattr(rw, "queue_step", None)
        publish: Callable[[int, dict[str, Any]], Any] = queue_step or (
            lambda step, fields: rw.step(step, **fields)
        )
        self.model = model
        self.optimizer = optimizer
        self.lr = lr_list(lr)
        self.clip = clip
        self.external_clip = external_clip
        self.update_every = update_every
        self.module_norms = module_norms
        self.flops_per_step = flops_per_step
        self.step = first_step  # the number the next end_step() publishes
        self.layout = ParamLayout(model, shard)
        self._probe = UpdateProbe(self.layout)
        # Forward hooks armed every activations_every steps (activations.py); None when turned off.
        self._activations = ActivationProbe(model, activations_every) if activations else None
        if self._activations is not None:
            self._activations.arm_for(first_step)
        # Replicas' parameter digests (fingerprint.py): a DDP model's ranks hold the same parameters;
        # ``replicas=True`` says so of another setup, False turns it off; a shard is not a replica.
        replicated = (is_ddp(model) if replicas is None else replicas) and not self.layout.sharded
        self._fingerprint = (
            ReplicaFingerprint(list(model.parameters()), fingerprint_every) if replicated else None
        )
        self._peak = peak_flops(self.layout.device, override=peak_flops_per_s)
        self._grad: GradNorms | HostGradNorms | None = None
        self._update: UpdateNorms | None = None
        self._closed = False
        self.errors = 0  # failures inside runwatch's own calls, logged once, never raised
        self._lr: list[float] | None = None  # read before the step, as the step used it
        self._warned_no_clip = False
        self._data_wrapped = False
        self._set_phase_name = "train"
        self._clock = clock or time.perf_counter
        self._off_step = OffStepTime(self._clock)  # eval/checkpoint/idle time, left out of step_time_s
        # On the wall clock memory is sampled at most every MEMORY_INTERVAL_S (a fast loop's steps share
        # a sample); on a clock of the caller's (a simulated run) every step, as the run is replayed.
        self._memory_interval_s = MEMORY_INTERVAL_S if clock is None else 0.0
        self._memory_at = -math.inf
        heartbeat: Heartbeat | None = None
        if heartbeat_s:
            gpu = gpu_source(gpu_health, self.layout.device, simulated=clock is not None)
            heartbeat = (
                Heartbeat(rw, heartbeat_s, clock=clock, stacks_after_s=stacks_after_s, gpu_health=gpu)
                if clock
                else Heartbeat(rw, heartbeat_s, stacks_after_s=stacks_after_s, gpu_health=gpu)
            )
        self.heartbeat = heartbeat  # never replaced: the step clock's callbacks below hold it
        self.sync_timer = ddp_sync_timer(model, self._clock, self.layout, heartbeat) if sync_timing else None
        # The steps whose figures are on their way to the host, published once they arrive
        self._steps = PendingSteps(
            self.layout, publish, module_norms=module_norms, sync_timer=self.sync_timer
        )
        self.clock = StepClock(
            self._clock,
            on_wait_begin=(lambda: heartbeat.push("dataload")) if heartbeat else None,
            on_wait_end=heartbeat.pop if heartbeat else None,
        )
        self._memory = memory_source(memory, self.layout.device)
        self.guard = step_guard(guard, self.layout)
        self._skip: SkipReason | None = None  # the guard's verdict on this step's update
        # The rollback LR scale held in each update (publish/lr_hold.py): created before the watcher's
        # own hooks, so that the LR the watcher reads in its pre-hook is the one the update uses.
        self._lr_hold = LRHold.of(optimizer) if optimizer is not None else None  # (None: no step hooks)
        self._lr_scale = 1.0
        # The guard's verdict carried out: with an optimizer, a skip takes its gradients away.
        self._update_guard = (
            UpdateGuard(self.guard, self.layout.params if optimizer is not None else None, self._lr_hold)
            if self.guard is not None
            else None
        )
        self._hook_handles: list[Any] = self._register_hooks(optimizer) if hooks else []
        # Whether the watched optimizer still steps: its pre-hook and a backward marker say (issue 37).
        self._stepping = OptimizerStepping(self.layout.params, hooked=bool(self._hook_handles))
        if self._hook_handles:
            self._hook_handles.extend(backward_marker(self.layout.params, self._stepping.mark_backward))
        if self.heartbeat and clock is None:
            self.heartbeat.start()
        self.clock.start()

    def _register_hooks(self, optimizer: torch.optim.Optimizer | None) -> list[Any]:
        """The optimizer's step hooks that call :meth:`before_optimizer_step` and
        :meth:`after_optimizer_step`; none without an optimizer."""
        if optimizer is None:
            return []
        return [
            optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.before_optimizer_step()),
            optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: self.after_optimizer_step()),
        ]

    # -- the three calls around a step ----------------------------------------------------

    def before_optimizer_step(self) -> None:
        """After backward (and AMP unscale), before ``optimizer.step()`` (or the hand-written update)."""
        with self._guard("before_optimizer_step"):
            self._before_optimizer_step()

    def _before_optimizer_step(self) -> None:
        self._stepping.stepped = True
        self._lr = self._current_lr()  # a scheduler may step before end_step
        if self._lr_hold is not None:
            self._lr_scale = self._lr_hold.scale
        clip = self.clip if self.clip is not None else self.external_clip
        norms = host_grad_norms if self.layout.on_host else grad_norms
        self._grad = norms(self.layout, clip, apply_clip=self.clip is not None)
        if self._update_guard is not None and self._grad is not None:
            self._skip = self._update_guard.judge(self._grad, self.step)
            if self._skip is not None:
                return  # (nothing to measure of an update that does not happen)
        if self.update_every and self.step % self.update_every == 0:
            self._probe.arm()

    def should_skip(self) -> bool:
        """Whether the guard skipped this step's update (after :meth:`before_optimizer_step`). With an
        optimizer the skip is done (its gradients are gone); a hand-written update (``optimizer=None``)
        must not apply itself when this is True."""
        return self._skip is not None

    def after_optimizer_step(self) -> None:
        """Right after ``optimizer.step()`` (or the hand-written update)."""
        if self._probe.armed:
            with self._guard("after_optimizer_step"):
                self._update = self._probe.measure()

    def end_step(
        self,
        loss: torch.Tensor | float | None,
        *,
        step: int | None = None,
        samples: int | None = None,
        tokens: int | None = None,
        category_loss: CategoryLossBatch | None = None,
        lr: float | Sequence[float] | None = None,
    ) -> None:
        """Publish the step event (on CUDA: the previous one; this one at the next call or close).

        ``lr``: the step's learning rate (one per param group), instead of the optimizer's or the
        watcher's ``lr`` option; for a hand-written update whose LR changes."""
        step = self.step if step is None else step
        with self._guard("end_step"):
            self._end_step(loss, step, samples, tokens, category_loss, lr)
        self.step = step + 1
        if self._activations is not None:
            self._activations.arm_for(self.step)
        if self.heartbeat:
            self.heartbeat.set_step(step)

    def _end_step(
        self,
        loss: torch.Tensor | float | None,
        step: int,
        samples: int | None,
        tokens: int | None,
        category_loss: CategoryLossBatch | None,
        step_lr: float | Sequence[float] | None = None,
    ) -> None:
        import torch

        step_time, data_wait = self.clock.lap()
        sync = self.sync_timer.close_round() if self.sync_timer is not None else None
        off_s, off_spans, off_by_phase = self._off_step.take(step_time is not None)
        if step_time is not None:
            step_time -= off_s
        lr, self._lr = self._lr, None
        if step_lr is not None:
            lr = lr_list(step_lr)
        fields: dict[str, Any] = {"lr": lr if lr is not None else self._current_lr()}
        skip, self._skip = self._skip, None
        if skip is not None:
            fields["update_skipped"] = skip
        if self._lr_scale != 1.0:
            fields["lr_scale"] = self._lr_scale
        if self._lr_hold is not None:
            self._lr_scale = self._lr_hold.scale  # (the next step's, unless its pre-hook reads it first)
        if self._data_wrapped:  # otherwise the source is missing: absent, not zero
            fields["data_wait_s"] = data_wait
        if off_by_phase and step_time is not None:  # (the time step_time_s left out, for goodput)
            fields["off_step_s"] = off_by_phase
        if step_time is not None and step_time > 0:
            self._add_rates(fields, step_time, samples, tokens)
        memory = self._memory.sample() if self._memory and self._memory_due() else None
        if memory is not None:
            fields["memory"] = memory
        if self.layout.sharded:
            fields["grad_sharded"] = True
        if self._stepping.not_stepping(step):
            fields["instrumentation"] = "optimizer_not_stepping"

        packing = StepPacking()
        pending = PendingStep(
            step=step, fields=fields, packing=packing, categories=category_loss, sync=sync, off_step=off_spans
        )
        if isinstance(loss, torch.Tensor):
            if self.layout.on_host and loss.device.type == "cpu" and loss.numel() == 1:
                fields["loss"] = float(loss.item())  # (in host memory: read at once, as the copy would)
            else:
                packing.add("loss", loss.detach().reshape(-1)[:1], 1)
        elif loss is not None:
            fields["loss"] = float(loss)
        self._pack_norms(pending, packing)
        halves = self._fingerprint.values(step) if self._fingerprint is not None else None
        if halves is not None:
            packing.add("param_digest", halves, DIGEST_VALUES)
        if category_loss is not None:
            packing.add("category_loss", category_loss.packed())
        taken = self._activations.take() if self._activations is not None else None
        if taken is not None:
            values, pending.activations = taken
            packing.add("activations", values, 2 * len(pending.activations))

        self._steps.ship(pending)

    def _add_rates(
        self, fields: dict[str, Any], step_time: float, samples: int | None, tokens: int | None
    ) -> None:
        """A timed step's (``step_time`` > 0) step time, throughput and model FLOPs utilisation."""
        fields["step_time_s"] = step_time
        if samples:
            fields["samples_per_s"] = samples / step_time
        if tokens:
            fields["tokens_per_s"] = tokens / step_time
        flops = self.flops_per_step or (
            transformer_flops_per_step(self.layout.n_params, tokens) if tokens else None
        )
        utilisation = mfu(flops, step_time, self._peak)
        if utilisation is not None:
            fields["mfu"] = utilisation

    def _pack_norms(self, pending: PendingStep, packing: StepPacking) -> None:
        """The step's gradient norms (read now if no hook measured them) and update norms, into the copy."""
        grad, self._grad = self._grad, None
        read_late = grad is None and self.optimizer is None
        if read_late:
            grad = self._grads_at_end_step()
        if grad is not None:
            # A shard's clip factor would need the global norm: left to the worker's join. Gradients
            # read after the update may have been clipped already: their clip factor says nothing.
            pending.clipped = (
                (self.clip is not None or self.external_clip is not None)
                and not self.layout.sharded
                and not read_late
            )
            if isinstance(grad, HostGradNorms):
                pending.grad = grad
            else:
                n_modules = len(self.layout.module_names)
                packing.add("grad", grad.figures, n_modules + 1)  # per-module norms, then the global norm
                packing.add("clip_coef", grad.clip_coef, 1)
                packing.add("nonfinite_grads", grad.nonfinite, 1)
        update, self._update = self._update, None
        if update is not None:
            packing.add("update", update.norms, 2)

    def _memory_due(self) -> bool:
        now = self._clock()
        if now - self._memory_at < self._memory_interval_s:
            return False
        self._memory_at = now
        return True

    def _current_lr(self) -> list[float]:
        if self.optimizer is not None:
            return [float(g["lr"]) for g in self.optimizer.param_groups]
        return list(self.lr or [])

    def _grads_at_end_step(self) -> GradNorms | HostGradNorms | None:
        """No optimizer and no ``before_optimizer_step`` this step: the norms of the gradients still
        there (after the update, so nothing is clipped)."""
        if self.clip is not None and not self._warned_no_clip:
            self._warned_no_clip = True
            log.warning(
                "runwatch: clip=%g did not clip: with optimizer=None call watch.before_optimizer_step() "
                "before the update",
                self.clip,
            )
        norms = host_grad_norms if self.layout.on_host else grad_norms
        return norms(self.layout, self.external_clip, apply_clip=False)

    # -- helpers for the rest of the loop ----------------------------------------------------

    def data(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Wrap the data iterator so the time spent waiting for batches is measured."""
        self._data_wrapped = True
        return self.clock.wrap(iterable)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with watch.phase("eval"): ...``: the heartbeat reports the phase, and time in
        ``eval``/``checkpoint``/``idle`` is left out of the next step's step time."""
        if self.heartbeat:
            self.heartbeat.push(name)
        off_step = name in OFF_STEP_PHASES
        if off_step:
            self._off_step.begin(name)
        try:
            yield
        finally:
            if off_step:
                self._off_step.end()
            if self.heartbeat:
                self.heartbeat.pop()

    def set_phase(self, name: str) -> None:
        """Switch phase without a ``with`` block, for frameworks whose hooks start and end a
        phase in different calls; the same accounting as :meth:`phase`."""
        if name == self._set_phase_name:
            return
        if self.heartbeat:
            self.heartbeat.enter(name)
        was_off, now_off = self._set_phase_name in OFF_STEP_PHASES, name in OFF_STEP_PHASES
        if now_off and not was_off:
            self._off_step.begin(name)
        elif was_off and not now_off:
            self._off_step.end()
        self._set_phase_name = name

    def eval(
        self,
        step: int,
        split: str = "val",
        loss: float | None = None,
        metrics: dict[str, float] | None = None,
        per_category: dict[str, Any] | CategoryLossBatch | None = None,
    ) -> bool:
        """Publish an eval event; ``per_category`` may be a ``category_loss`` batch."""
        return self.rw.eval(
            step,
            split=split,
            loss=loss,
            metrics=metrics or {},
            per_category=per_category_metrics(per_category),
        )

    def close(self) -> None:
        """Publish the last pending step, stop the heartbeat and remove the hooks (``rw`` stays open)."""
        if self._closed:
            return
        self._closed = True
        with self._guard("close"):
            self._steps.flush()
        for handle in self._hook_handles:
            handle.remove()
        if self._activations is not None:
            self._activations.remove()
        if self.heartbeat:
            self.heartbeat.stop()

    @contextlib.contextmanager
    def _guard(self, where: str) -> Iterator[None]:
        """Telemetry must not end a training run: a failure is logged once and counted."""
        try:
            yield
        except Exception as exc:
            self.errors += 1
            if self.errors == 1:
                log.warning(
                    "runwatch: %s failed (further failures are only counted in watch.errors): %r",
                    where,
                    exc,
                    exc_info=True,
                )
