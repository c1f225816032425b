"""Hugging Face ``TrainerCallback``: the ``rw.watch`` instrumentation for a ``transformers.Trainer``.

::

    from runwatch.producer import RunWatch
    from runwatch.producer.integrations.hf import RunWatchCallback

    rw = RunWatch("run-42", bootstrap)
    trainer = Trainer(model=model, args=args, train_dataset=..., callbacks=[RunWatchCallback(rw)])
    trainer.train()
    rw.close()

Where each measurement sits in ``Trainer._inner_training_loop`` (transformers 4.47 to 5.17, read
from its source):

- After the last micro-batch's backward the Trainer clips (``if args.max_grad_norm > 0:
  self._clip_grad_norm(model)``), then calls ``on_pre_optimizer_step``, ``optimizer.step()``,
  ``on_optimizer_step``, the LR scheduler, ``zero_grad``, ``global_step += 1`` and ``on_step_end``.
  A callback therefore only ever sees clipped gradients. To report the norm before clipping, this
  callback takes clipping over: at ``on_train_begin`` it moves ``args.max_grad_norm`` into the
  watcher's ``clip`` (same maths as ``clip_grad_norm_``) and sets ``args.max_grad_norm = 0``; the
  loop reads the attribute at every step, so the Trainer stops clipping. The value is put back at
  ``on_train_end``. Not done under DeepSpeed or FSDP (their gradients are sharded and they clip
  themselves): there the figures are per-rank and after the framework's clipping, and a warning
  says so. Pass ``take_over_clipping=False`` to leave clipping to the Trainer.
- fp16 AMP: transformers 5.17 unscales the gradients before ``on_pre_optimizer_step`` even
  without clipping (it computes the norm for its logs through ``accelerator.clip_grad_norm_``);
  4.47 to 5.0 do not, so the callback unscales through the accelerated optimizer's ``GradScaler``
  itself, as accelerate does before clipping (skipped when already unscaled this step).
- The per-step loss is not handed to callbacks (only ``on_log``'s average over ``logging_steps``).
  A forward hook on the model takes the ``loss`` entry of the model's output during training
  forwards: per micro-batch means are averaged over the accumulation window, partial sums
  (the model was given ``num_items_in_batch``) are added, as the Trainer's own ``tr_loss`` does.
  A loss computed outside the model (``compute_loss_func``, label smoothing, an overridden
  ``compute_loss``) is not seen: give it with :meth:`RunWatchCallback.record_loss`, else the step
  event has no loss. The same hook counts samples (the first tensor's first dimension).
- ``on_evaluate`` -> an ``eval`` event (rank 0): ``eval_loss`` is the loss, the other
  ``eval_*`` entries are metrics; split ``val`` (or the eval dataset's name when ``eval_dataset``
  is a dict).
- Phases: after ``on_step_end``/``on_epoch_end`` the Trainer logs, evaluates, then saves, as
  ``control`` says; the phase follows: ``eval`` until ``on_evaluate``, ``checkpoint`` until
  ``on_save``. Their time is kept out of the next step's time.

``rw`` stays open: close it (``rw.close()``) after ``train()`` returns, with the status you choose.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "runwatch.producer.integrations.hf needs transformers and accelerate: pip install 'runwatch[hf]'"
    ) from exc

if TYPE_CHECKING:
    import torch
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from runwatch.producer.instrument.watch import Watcher
    from runwatch.producer.publish.run_watch import RunWatch

log = logging.getLogger(__name__)


class _TrainLossProbe:
    """Forward hook that keeps the loss and sample count of the training forwards of one step."""

    def __init__(self, model: torch.nn.Module, loss_scale: float):
        self.loss_scale = loss_scale
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)
        self.reset()

    def reset(self) -> None:
        self.means: list[torch.Tensor] = []  # per micro-batch means: averaged
        self.partials: list[torch.Tensor] = []  # already divided by the window's item count: added
        self.samples = 0

    def remove(self) -> None:
        self._handle.remove()

    def _hook(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        import torch

        if not module.training or not torch.is_grad_enabled():
            return  # evaluation or generation
        self.samples += _leading_dim(args, kwargs)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        loss = loss.detach().float().reshape(())
        if kwargs.get("num_items_in_batch") is not None:
            self.partials.append(loss * self.loss_scale)
        else:
            self.means.append(loss)

    def step_loss(self) -> torch.Tensor | None:
        import torch

        if self.partials:
            return torch.stack(self.partials).sum()
        if self.means:
            return torch.stack(self.means).mean()
        return None


class RunWatchCallback(TrainerCallback):
    """Publishes step, eval and heartbeat events from a ``transformers.Trainer`` through ``rw``.

    ``watch_kwargs`` go to ``rw.watch`` (``update_every``, ``heartbeat_s``, ...); ``hooks`` is
    always False here. ``take_over_clipping`` (default True) moves ``args.max_grad_norm`` into
    runwatch so that the norm before clipping is visible.
    """

    def __init__(self, rw: RunWatch, *, take_over_clipping: bool = True, **watch_kwargs: Any):
        if watch_kwargs.pop("hooks", False):
            raise ValueError(
                "RunWatchCallback drives the watcher from the Trainer's events: do not pass hooks=True"
            )
        self.rw = rw
        self.take_over_clipping = take_over_clipping
        self.watch_kwargs = watch_kwargs
        self.watch: Watcher | None = None
        self._probe: _TrainLossProbe | None = None
        self._recorded: list[torch.Tensor | float] = []
        self._stepped = False
        self._unscale_with: Any = None  # the accelerated optimizer when its GradScaler is ours to drive
        self._max_grad_norm_taken: float | None = None

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Give the loss of one micro-batch when the model's output does not carry it."""
        import torch

        self._recorded.append(
            loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else float(loss)
        )

    # -- lifecycle --------------------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.watch is not None:
            self._close_watch(args)
        if model is None or optimizer is None:
            log.warning(
                "runwatch: the Trainer passed no model or optimizer to the callback; nothing to watch"
            )
            return
        watch_kwargs = dict(self.watch_kwargs)
        max_norm = float(args.max_grad_norm or 0.0)
        sharded = _sharded_training(args)
        if max_norm > 0 and watch_kwargs.get("clip") is None and watch_kwargs.get("external_clip") is None:
            if self.take_over_clipping and not sharded:
                watch_kwargs["clip"] = max_norm
                self._max_grad_norm_taken = max_norm
                args.max_grad_norm = 0.0  # read by the loop at every step: the Trainer stops clipping
            else:
                log.warning(
                    "runwatch: the Trainer clips gradients (max_grad_norm=%s) before callbacks see them: "
                    "grad_norm is reported after clipping",
                    max_norm,
                )
        elif max_norm > 0 and watch_kwargs.get("clip") is not None:
            raise ValueError(
                f"TrainingArguments(max_grad_norm={max_norm}) already clips; drop clip= from "
                "RunWatchCallback (it takes the Trainer's max_grad_norm over)"
            )
        if sharded:
            log.warning("runwatch: DeepSpeed/FSDP shard gradients: gradient norms are this rank's shard")
        if self._max_grad_norm_taken is not None and getattr(optimizer, "scaler", None) is not None:
            self._unscale_with = optimizer
        watch_kwargs.setdefault("first_step", state.global_step + 1)
        self.watch = self.rw.watch(model, optimizer, hooks=False, **watch_kwargs)
        average_across = getattr(args, "average_tokens_across_devices", False) and args.world_size > 1
        self._probe = _TrainLossProbe(model, loss_scale=float(args.world_size) if average_across else 1.0)
        self._reset_step()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close_watch(args)

    # -- training steps -----------------------------------------------------------------------

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._set_phase("train")

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.watch is None:
            return
        if self._unscale_with is not None:
            # fp16: the clip must see true gradients. Raises when already unscaled this step.
            with contextlib.suppress(RuntimeError):
                self._unscale_with.scaler.unscale_(self._unscale_with.optimizer)
        self.watch.before_optimizer_step()
        self._stepped = True

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.watch is not None and self._stepped:
            self.watch.after_optimizer_step()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.watch is None or not self._stepped:
            return
        loss = self._step_loss()
        samples = self._probe.samples if self._probe is not None else 0
        self.watch.end_step(loss, step=state.global_step, samples=samples or None)
        self._reset_step()
        self._follow_control(control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._follow_control(control)

    # -- evaluation and checkpoints ---------------------------------------------------------

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._set_phase("eval")  # evaluation started some other way than the training loop's schedule

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self.watch is None:
            return
        if state.is_world_process_zero and metrics:
            split, loss, values = _split_eval_metrics(metrics)
            self.watch.eval(state.global_step, split, loss, values)
        self._set_phase("checkpoint" if control.should_save else "train")

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._set_phase("train")

    # -- helpers --------------------------------------------------------------------------------

    def _step_loss(self) -> torch.Tensor | float | None:
        recorded, self._recorded = self._recorded, []
        if recorded:
            import torch

            values = [torch.as_tensor(v, dtype=torch.float32) for v in recorded]
            return torch.stack([v.to(values[0].device) for v in values]).mean()
        return self._probe.step_loss() if self._probe is not None else None

    def _reset_step(self) -> None:
        self._stepped = False
        self._recorded = []
        if self._probe is not None:
            self._probe.reset()

    def _follow_control(self, control: TrainerControl) -> None:
        # The Trainer now logs, then evaluates, then saves, as control says.
        if control.should_evaluate:
            self._set_phase("eval")
        elif control.should_save:
            self._set_phase("checkpoint")

    def _set_phase(self, name: str) -> None:
        if self.watch is not None:
            self.watch.set_phase(name)  # eval and checkpoint time stays out of the next step's time

    def _close_watch(self, args: TrainingArguments) -> None:
        if self._max_grad_norm_taken is not None:
            args.max_grad_norm = self._max_grad_norm_taken
            self._max_grad_norm_taken = None
        self._unscale_with = None
        if self._probe is not None:
            self._probe.remove()
            self._probe = None
        if self.watch is None:
            return
        self._set_phase("train")
        try:
            self.watch.close()
        finally:
            self.watch = None


def _sharded_training(args: TrainingArguments) -> bool:
    env = os.environ
    return bool(
        getattr(args, "deepspeed", None)
        or getattr(args, "fsdp", None)
        or env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
        or env.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    )


def _leading_dim(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 0


def _split_eval_metrics(metrics: Mapping[str, Any]) -> tuple[str, float | None, dict[str, float]]:
    """``eval_loss``/``eval_acc`` (or ``eval_<name>_loss`` for a dict of eval
    datasets) -> split, loss, metrics."""
    prefix = "eval_"
    for key in metrics:  # the Trainer always reports <prefix>runtime; it fixes the prefix
        if key.endswith("_runtime"):
            prefix = key[: -len("runtime")]
            break
    split = prefix.rstrip("_").removeprefix("eval").strip("_") or "val"
    loss: float | None = None
    values: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "epoch" or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        name = key.removeprefix(prefix)
        if name == "loss":
            loss = float(value)
        else:
            values[name] = float(value)
    return split, loss, values
