"""Applying an action on this rank, and acknowledging it.

- ``rollback`` restores a checkpoint (see :meth:`ActionApplier.choose_checkpoint`), puts the run's
  own LR back (recorded with the checkpoint: the restored state's may be the fault) and holds the
  action's ``params.lr_scale`` (cumulative, relative to the run's LR before any rollback) inside
  every optimizer step (``publish/lr_hold.py``): a scheduler or a loop that sets its LR each step
  does not undo it. After ``params.lr_restore_after_steps`` healthy steps the scale returns to 1
  over ``params.lr_restore_over_steps``. ``params.skip_steps`` (policy ``skip_data_window``, on by
  default) becomes ``applied.skip_steps``, the inclusive step range from the restored checkpoint's
  step + 1 to the anomaly's step whose batches the loop does not replay.
- ``pause`` blocks until a ``resume`` (or a ``stop``) arrives or ``pause_timeout_s`` (or
  ``params.timeout_s``) passes; the ack's detail says which. Actions that arrive meanwhile are
  applied after the pause, in order. With a heartbeat the pause is reported as the ``idle``
  phase, so it is not taken for a stall.
- ``stop`` is handed to the loop (``poll`` returns it), which exits gracefully; ``alert`` and
  ``recovered`` only say so (their detail is the reason: what the worker saw, or that a rollback
  brought the run back to its loss before the fault).

Each applied action is logged at INFO on ``runwatch.producer.actions.apply``.

Every outcome (applied or failed) is remembered in the rank's applied ids, on disk, before this
rank acknowledges it with an ``action_ack`` event.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runwatch.contract.action_kinds import Applies, applies
from runwatch.contract.schema import Action, CheckpointRef, newest_checkpoint_before, utc_now
from runwatch.producer.actions.applied_ids import AppliedIds
from runwatch.producer.actions.arrivals import Arrivals
from runwatch.producer.actions.checkpoints import RestoreFn
from runwatch.producer.publish.lr import restore_base_lr, scale_lr_once
from runwatch.producer.publish.lr_hold import LRHold

if TYPE_CHECKING:
    from runwatch.producer.publish.publisher import ActionPublisher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppliedAction:
    """What :meth:`ActionListener.poll` tells the training loop."""

    action: Action
    outcome: str  # applied | failed
    from_step: int | None = None
    to_step: int | None = None  # for a rollback: the step of the restored checkpoint
    detail: str | None = None
    lr_scale: float | None = None  # rollback: the cumulative LR scale now in effect (None: LR untouched)
    lr_factor: float | None = None  # rollback: what this rollback multiplied the restored LR by
    skip_steps: tuple[int, int] | None = None  # rollback: steps (inclusive) whose batches to skip

    @property
    def kind(self) -> str:
        return self.action.kind

    def skips(self, step: int) -> bool:
        """Whether the batch of ``step`` is in the data window this rollback says to skip."""
        return self.skip_steps is not None and self.skip_steps[0] <= step <= self.skip_steps[1]


class ActionApplier:
    """Applies actions to this rank's model, optimizer and loop, and acknowledges them through
    ``rw``. ``restore``, ``optimizer`` and ``heartbeat`` may be set later (``attach``)."""

    def __init__(
        self,
        rw: ActionPublisher,
        arrivals: Arrivals,
        applied_ids: AppliedIds,
        ignored: Counter[str],
        *,
        restore: RestoreFn | None,
        optimizer: Any,
        heartbeat: Any,
        pause_timeout_s: float,
    ):
        self.rw = rw
        self.restore = restore
        self.optimizer = optimizer
        self.heartbeat = heartbeat
        self._arrivals = arrivals
        self._applied_ids = applied_ids
        self._ignored = ignored
        self._pause_timeout_s = pause_timeout_s
        self._ended_pause: dict[str, str] = {}  # resume/stop action id -> the pause it ended
        self.applied: list[AppliedAction] = []

    def apply(self, action: Action, step: int | None, check_expiry: bool = True) -> AppliedAction | None:
        """Apply ``action`` and acknowledge it; None if it expired while it waited (counted)."""
        try:
            return self._apply(action, step, check_expiry)
        finally:
            self._arrivals.done(action.action_id)

    def _apply(self, action: Action, step: int | None, check_expiry: bool) -> AppliedAction | None:
        # (it may have waited in the queue; judged on the issuing worker's clock: Action.issuer_now)
        if check_expiry and action.is_expired(action.issuer_now(utc_now(), self.rw.rank)):
            self._ignored["expired"] += 1
            return None
        handler = self._HANDLERS[applies(action.kind)]  # one per way of applying (contract/action_kinds.py)
        return self.record(handler(self, action, step), step)

    def _note(self, action: Action, step: int | None) -> AppliedAction:
        """An alert or a recovery: nothing to do here but acknowledge it (and end a pause it ended). Its
        detail is the reason, so the loop's log says what the worker saw."""
        ended = self._ended_pause.pop(action.action_id, None)
        return AppliedAction(
            action, "applied", from_step=step, detail=f"ended pause {ended}" if ended else action.reason
        )

    def _resume(self, action: Action, step: int | None) -> AppliedAction:
        ended = self._ended_pause.pop(action.action_id, None)
        return AppliedAction(
            action, "applied", from_step=step, detail=f"ended pause {ended}" if ended else "not paused"
        )

    def _stop(self, action: Action, step: int | None) -> AppliedAction:
        """Handed to the training loop, which decides what a stop means for it."""
        result = self._note(action, step)
        self.rw.note_stop(action)  # run_end then says "stopped", with this action's id and cause
        return result

    def record(self, result: AppliedAction, step: int | None) -> AppliedAction:
        """Remember ``result`` (on disk first: a restart never applies it again), then acknowledge it."""
        action = result.action
        self.applied.append(result)
        self._applied_ids.add(action.action_id)
        log.info("runwatch: step %s: %s %s: %s", step, action.kind, result.outcome, result.detail or "")
        self.rw.ack(
            action_id=action.action_id,
            action_kind=action.kind,
            outcome=result.outcome,
            detail=result.detail,
            step=step,
            to_step=result.to_step,
        )
        return result

    def choose_checkpoint(self, action: Action) -> CheckpointRef | None:
        """The checkpoint to restore: the action's target if we registered it, else our newest
        checkpoint strictly before the anomaly's onset. A listener that registered no checkpoint
        at all (a rank other than the one that saves and announces them) takes the target."""
        registered = self.rw.checkpoints
        target = action.target_checkpoint
        if target is not None and (
            not registered or any(c.step == target.step and c.uri == target.uri for c in registered)
        ):
            return target
        onset = action.onset_step if action.onset_step is not None else action.step
        return newest_checkpoint_before(registered, onset)

    def _rollback(self, action: Action, step: int | None) -> AppliedAction:
        ref = self.choose_checkpoint(action)
        if ref is None:
            return AppliedAction(
                action, "failed", from_step=step, detail="no registered checkpoint before the onset"
            )
        if self.restore is None:
            return AppliedAction(action, "failed", from_step=step, detail="no model given to restore into")
        try:
            self.restore(ref)
        except Exception as exc:  # noqa: BLE001 - the caller's restore may raise anything
            return AppliedAction(action, "failed", from_step=step, detail=f"restore failed: {exc!r}")
        detail = f"restored {ref.uri}"
        lr_scale = lr_factor = None
        wanted = action.params.get("lr_scale")
        if wanted is not None and self.optimizer is not None:
            try:
                # The run's own LR before the fault: recorded with the checkpoint (or at the start),
                # not the LR in the restored optimizer state, which may be the fault itself.
                base = ref.lr if ref.lr is not None else self.rw.initial_lr
                lr_scale = float(wanted)
                lr_factor = restore_base_lr(self.optimizer, lr_scale, base)
                restore_after = action.params.get("lr_restore_after_steps")
                hold = LRHold.of(self.optimizer)
                detail += f"; LR x{lr_factor:g} (x{lr_scale:g} of the run's LR before the fault"
                if hold is None:  # (an optimizer without step hooks: written once, as a loop may undo)
                    scale_lr_once(self.optimizer, lr_scale)
                    detail += ", written into its LR once: the optimizer takes no step hooks)"
                else:
                    hold.hold(
                        lr_scale,
                        restore_after=int(restore_after) if restore_after is not None else None,
                        restore_over=int(action.params.get("lr_restore_over_steps") or 100),
                    )
                    detail += (
                        f", held in every step until {int(restore_after)} healthy steps)"
                        if restore_after is not None
                        else ", held in every step)"
                    )
            except Exception as exc:  # noqa: BLE001 - any optimizer: the restore happened, so report
                # it, and that the LR did not change
                detail += f"; LR not scaled: {exc!r}"
        elif wanted is not None:
            detail += "; LR not scaled: no optimizer attached"
        skip = None
        window = action.params.get("skip_steps")
        if isinstance(window, list | tuple) and len(window) == 2 and window[1] is not None:
            first, last = ref.step + 1, int(window[1])
            if first <= last:
                skip = (first, last)
                detail += f"; skip the batches of steps {first}..{last}"
        return AppliedAction(
            action,
            "applied",
            from_step=step,
            to_step=ref.step,
            detail=detail,
            lr_scale=lr_scale,
            lr_factor=lr_factor,
            skip_steps=skip,
        )

    def _pause(self, action: Action, step: int | None) -> AppliedAction:
        """Blocks until a pause ender arrives or the timeout passes (arrivals wait, in order)."""
        timeout = float(action.params.get("timeout_s", self._pause_timeout_s))
        started = time.monotonic()
        deadline = started + timeout
        after = self._arrivals.arrival_of(action.action_id)  # only what arrived after the pause ends it
        if self.heartbeat is not None:
            self.heartbeat.push("idle")
        try:
            while True:
                # Arrivals stay pending: applied (and acknowledged) after the pause, in order.
                ender = self._arrivals.pause_ender(after)
                if ender is not None:
                    self._ended_pause[ender.action_id] = action.action_id
                    waited = time.monotonic() - started
                    return AppliedAction(
                        action,
                        "applied",
                        from_step=step,
                        detail=f"paused {waited:.1f} s until {ender.kind} {ender.action_id}",
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return AppliedAction(
                        action,
                        "applied",
                        from_step=step,
                        detail=f"pause timed out after {timeout:g} s; resuming",
                    )
                self._arrivals.pull(timeout=min(0.1, remaining))
        finally:
            if self.heartbeat is not None:
                self.heartbeat.pop()

    _HANDLERS: dict[Applies, Callable[[ActionApplier, Action, int | None], AppliedAction]] = {
        "note": _note,
        "pause": _pause,
        "resume": _resume,
        "rollback": _rollback,
        "stop": _stop,
    }
