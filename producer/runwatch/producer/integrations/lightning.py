"""PyTorch Lightning callback: the ``rw.watch`` instrumentation for a ``lightning`` Trainer.

::

    from runwatch.producer import RunWatch
    from runwatch.producer.integrations.lightning import RunWatchCallback

    rw = RunWatch("run-42", bootstrap)
    trainer = lightning.Trainer(callbacks=[RunWatchCallback(rw, update_every=10)], gradient_clip_val=1.0)
    trainer.fit(model, train_loader, val_loader)
    rw.close()

Where each measurement sits in Lightning's loop (lightning 2.x, read from its source):

- ``on_before_optimizer_step`` runs inside ``optimizer.step(closure)``, after the closure (forward
  and backward) and after the AMP scaler's ``unscale_``, and before Lightning clips gradients
  (``Precision._after_closure``). That is where the watcher measures gradient norms. A torch
  optimizer step pre-hook would fire before the closure, i.e. before backward, so the watcher is
  built with ``hooks=False`` and driven from here.
- Lightning clips right after that hook, by ``Trainer(gradient_clip_val=...)``; with the ``norm``
  algorithm (the default) the watcher is told so (``external_clip``) and reports the clipped norm
  and clip ratio arithmetically. Clipping by value is not a total-norm clip: nothing is reported
  as clipped then. A ``configure_gradient_clipping`` override is not seen.
- There is no hook after the optimizer step; ``on_train_batch_end`` of the batch whose step ran is
  the first one after it (the LR scheduler has stepped by then, which does not change the weights).
- With gradient accumulation the optimizer steps once every ``accumulate_grad_batches`` batches:
  one step event per optimizer step, with the mean loss and the sum of samples of its batches.
  ``outputs["loss"]`` is the loss divided by ``accumulate_grad_batches`` in automatic
  optimization; it is scaled back.
- Validation: an ``eval`` event (rank 0, split ``val``) at ``on_validation_end`` with what was
  logged during validation (``trainer.callback_metrics`` entries that changed); a key ``val_loss``,
  ``val/loss`` or ``loss`` becomes the event's loss, other ``val_``/``val/`` prefixes are dropped.
  The sanity check is not reported.
- Phases: ``eval`` during validation, ``checkpoint`` from ``on_save_checkpoint`` (called just before
  the file is written; Lightning has no hook after the write, so the phase ends at the next hook:
  the next batch, validation, or the end of training).

``rw`` stays open: close it (``rw.close()``) after ``fit`` returns, with the status you choose.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "runwatch.producer.integrations.lightning needs PyTorch Lightning: pip install 'runwatch[lightning]'"
    ) from exc

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

    from runwatch.producer.instrument.watch import Watcher
    from runwatch.producer.publish.run_watch import RunWatch

log = logging.getLogger(__name__)

_LOSS_KEYS = ("loss", "val_loss", "val/loss", "validation_loss", "valid_loss")
_PREFIXES = ("val_", "val/", "validation_", "validation/", "valid_", "valid/")


class RunWatchCallback(Callback):
    """Publishes step, eval and heartbeat events from a Lightning ``Trainer`` through ``rw``.

    ``watch_kwargs`` go to ``rw.watch`` (``update_every``, ``heartbeat_s``, ``clip``, ...);
    ``hooks`` is always False here. Give ``clip`` only if Lightning does not clip
    (``gradient_clip_val`` unset): runwatch then clips by total norm itself.
    """

    def __init__(self, rw: RunWatch, **watch_kwargs: Any):
        if watch_kwargs.pop("hooks", False):
            raise ValueError(
                "RunWatchCallback drives the watcher from Lightning's hooks: do not pass hooks=True"
            )
        self.rw = rw
        self.watch_kwargs = watch_kwargs
        self.watch: Watcher | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._stepped = False  # an optimizer step ran since the last step event
        self._loss_sum: torch.Tensor | float | None = None
        self._loss_count = 0
        self._samples = 0
        self._metrics_before: dict[str, Any] = {}

    # -- lifecycle ----------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.watch is not None:  # a second fit() with the same callback
            self._close_watch()
        if not trainer.optimizers:
            log.warning("runwatch: the Lightning module has no optimizer; nothing to watch")
            return
        if len(trainer.optimizers) > 1:
            log.warning("runwatch: %d optimizers; only the first one is watched", len(trainer.optimizers))
        self._optimizer = trainer.optimizers[0]
        kwargs = dict(self.watch_kwargs)
        clip_val = trainer.gradient_clip_val
        algorithm = trainer.gradient_clip_algorithm
        lightning_clips_norm = bool(clip_val) and (algorithm is None or str(algorithm.value) == "norm")
        if lightning_clips_norm and clip_val is not None:  # (bool(clip_val) implies not None)
            if kwargs.get("clip") is not None:
                raise ValueError(
                    f"Trainer(gradient_clip_val={clip_val}) already clips by norm; drop clip= from "
                    "RunWatchCallback (runwatch reports Lightning's clipping) or drop gradient_clip_val"
                )
            kwargs.setdefault("external_clip", float(clip_val))
        # Step numbers follow trainer.global_step (optimizer steps done); the next event is global_step + 1.
        kwargs.setdefault("first_step", trainer.global_step + 1)
        self.watch = self.rw.watch(pl_module, self._optimizer, hooks=False, **kwargs)
        self._reset_accumulation()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_watch()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close_watch()

    # -- training steps -----------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._set_phase("train")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.watch is None or optimizer is not self._optimizer:
            return
        self.watch.before_optimizer_step()
        self._stepped = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.watch is None:
            return
        loss = _loss_from_outputs(outputs)
        if loss is not None:
            if pl_module.automatic_optimization:
                loss = loss * trainer.accumulate_grad_batches  # Lightning divided it for backward
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1
        self._samples += _batch_size(batch)
        if not self._stepped:
            return  # accumulating: the optimizer has not stepped yet
        self.watch.after_optimizer_step()
        mean_loss = self._loss_sum / self._loss_count if self._loss_sum is not None else None
        self.watch.end_step(mean_loss, step=trainer.global_step, samples=self._samples or None)
        self._reset_accumulation()

    # -- validation and checkpoints -------------------------------------------------------

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.watch is None or trainer.sanity_checking:
            return
        # References, not ids: a freed tensor's id can be reused by its replacement.
        self._metrics_before = dict(trainer.callback_metrics)
        self._set_phase("eval")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.watch is None or trainer.sanity_checking:
            return
        self._set_phase("train")
        if trainer.is_global_zero:
            # What validation logged is what it replaced or added in callback_metrics.
            logged = {
                k: v for k, v in trainer.callback_metrics.items() if self._metrics_before.get(k) is not v
            }
            self._metrics_before = {}
            loss, metrics = _split_eval_metrics(logged)
            self.watch.eval(trainer.global_step, "val", loss, metrics)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.watch is not None and not trainer.sanity_checking:
            self._set_phase("checkpoint")  # ends at the next hook: Lightning has none after the write

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set_phase("train")

    # -- helpers ------------------------------------------------------------------------------

    def _reset_accumulation(self) -> None:
        self._stepped = False
        self._loss_sum = None
        self._loss_count = 0
        self._samples = 0

    def _set_phase(self, name: str) -> None:
        if self.watch is not None:
            self.watch.set_phase(name)  # eval and checkpoint time stays out of the next step's time

    def _close_watch(self) -> None:
        if self.watch is None:
            return
        self._set_phase("train")
        try:
            self.watch.close()
        finally:
            self.watch = None
            self._optimizer = None


def _loss_from_outputs(outputs: Any) -> torch.Tensor | float | None:
    import torch

    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        return outputs.detach().float().reshape(())
    if isinstance(outputs, (int, float)):
        return float(outputs)
    return None


def _batch_size(batch: Any) -> int:
    from lightning.pytorch.utilities.data import extract_batch_size

    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - a batch with no tensor in it: samples are unknown, not zero
        return 0


def _split_eval_metrics(logged: Mapping[str, Any]) -> tuple[float | None, dict[str, float]]:
    loss: float | None = None
    metrics: dict[str, float] = {}
    for key, value in logged.items():
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):  # a non-scalar tensor or an object
            continue
        if key in _LOSS_KEYS and loss is None:
            loss = number
            continue
        name = key
        for prefix in _PREFIXES:
            if name.startswith(prefix) and len(name) > len(prefix):
                name = name[len(prefix) :]
                break
        if math.isfinite(number) or name not in metrics:
            metrics[name] = number
    return loss, metrics
