"""``ActionListener``: the trainer's side of the action topic.

A daemon thread consumes ``runwatch.actions`` and keeps only actions that are
signed with the shared secret, addressed to this run, unexpired, issued after the
listener started (minus a clock-skew allowance) and not seen before. Everything else
is counted in ``ignored`` by reason. Training code calls :meth:`poll` once per step;
it never waits on the network (except while paused, which is the point of a pause).

Actions are per run, not per rank: every rank's listener reads every action of its run (no
consumer group), applies it at its own next :meth:`poll` and acknowledges it with its own rank.

- ``rollback`` restores a checkpoint (see :meth:`ActionListener.choose_checkpoint`), then scales
  the LR of every param group of the attached optimizer. The action's ``params.lr_scale`` is
  cumulative, relative to the run's LR before any rollback; each param group carries the scale
  already in its LR under ``runwatch_lr_scale`` (saved and restored with the optimizer's state),
  so the group's LR at restore time is multiplied by ``lr_scale / carried``: restoring a
  checkpoint taken before an earlier rollback (carried 1.0) and one taken after it (carried 0.5)
  both end at ``lr_scale`` times the original LR. An LR scheduler that sets the LR from its own
  ``base_lrs`` each step overrides this: scale those by ``applied.lr_factor`` too.
  ``params.skip_steps`` (policy ``skip_data_window``) becomes ``applied.skip_steps``, the
  inclusive step range from the restored checkpoint's step + 1 to the anomaly's step whose
  batches the loop should not replay.
- ``pause`` blocks inside :meth:`poll` until a ``resume`` (or a ``stop``) arrives or
  ``pause_timeout_s`` (or ``params.timeout_s``) passes; the ack's detail says which. Actions that
  arrive meanwhile are applied after the pause, in order. With ``heartbeat=`` the pause is
  reported as the ``idle`` phase, so it is not taken for a stall.
- ``stop`` is handed to the loop (``poll`` returns it and stops there), which exits gracefully.
  With ``stop_exit_after_s`` a watchdog then ends the process with ``os._exit(stop_exit_code)``
  if it is still alive that long after the stop (a loop stuck in a collective, a hung shutdown);
  :meth:`ActionListener.stop_deadline` arms the same watchdog by hand.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from runwatch.producer import topics
from runwatch.producer.publisher import RunWatch
from runwatch.producer.schema import (
    Action,
    CheckpointRef,
    SchemaError,
    decode_action,
    newest_checkpoint_before,
    utc_now,
)
from runwatch.producer.signing import resolve_secret, verify_action

log = logging.getLogger(__name__)

RestoreFn = Callable[[CheckpointRef], None]
LR_SCALE_KEY = "runwatch_lr_scale"  # in each param group: the rollback LR scale its LR already carries


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


def scale_lr(optimizer: Any, lr_scale: float) -> float:
    """Bring every param group's LR to ``lr_scale`` times the run's original LR, given the scale
    the group already carries (``runwatch_lr_scale``, 1.0 if none); returns the factor applied."""
    factor = 1.0
    for group in optimizer.param_groups:
        carried = float(group.get(LR_SCALE_KEY, 1.0))
        factor = lr_scale / carried
        lr = group["lr"]
        if hasattr(lr, "mul_"):  # a tensor LR (capturable optimizers): keep the same tensor
            lr.mul_(factor)
        else:
            group["lr"] = lr * factor
        group[LR_SCALE_KEY] = lr_scale
    return factor


def save_checkpoint(path: str, model: Any, optimizer: Any = None, **extra: Any) -> None:
    """Write a checkpoint in the layout the default rollback restores."""
    import torch

    state = {"model": model.state_dict(), **extra}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    torch.save(state, path)


def torch_restore(model: Any, optimizer: Any = None) -> RestoreFn:
    def restore(ref: CheckpointRef) -> None:
        import torch

        state = torch.load(ref.uri, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        if optimizer is not None and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])

    return restore


class ActionListener:
    def __init__(
        self,
        rw: RunWatch,
        model: Any = None,
        optimizer: Any = None,
        *,
        secret: str | bytes | None = None,
        restore: RestoreFn | None = None,
        clock_skew_s: float = 30.0,
        pause_timeout_s: float = 300.0,
        heartbeat: Any = None,
        stop_exit_after_s: float | None = None,
        stop_exit_code: int = 1,
        topic: str = topics.ACTIONS,
        consume: bool = True,
    ):
        self.rw = rw
        self._secret = resolve_secret(secret)
        if restore is None and model is not None:
            restore = torch_restore(model, optimizer)
        self._restore = restore
        self._optimizer = optimizer
        self._heartbeat = heartbeat
        self._not_before = utc_now() - timedelta(seconds=clock_skew_s)
        self._pause_timeout_s = pause_timeout_s
        self._stop_exit_after_s = stop_exit_after_s
        self._stop_exit_code = stop_exit_code
        self._watchdog_disarmed = threading.Event()
        self._topic = topic
        self._accepted: queue.Queue[Action] = queue.Queue()
        self._deferred: deque[Action] = deque()  # arrived during a pause: applied after it, in order
        self._ended_pause: dict[str, str] = {}  # resume/stop action id -> the pause it ended
        self._seen: set[str] = set()
        self.ignored: Counter[str] = Counter()
        self.applied: list[AppliedAction] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._consume, name="runwatch-actions", daemon=True)
        if consume:  # False: no consumer (tests, another transport); raw actions go to _accept
            self._thread.start()

    # -- what training code calls -------------------------------------------------

    def attach(self, model: Any, optimizer: Any = None, restore: RestoreFn | None = None,
               heartbeat: Any = None) -> None:
        """Set what a rollback restores into (and whose LR it scales), for listeners created
        before the model; ``heartbeat`` (``watch.heartbeat``) reports a pause as idle."""
        self._restore = restore or torch_restore(model, optimizer)
        self._optimizer = optimizer
        if heartbeat is not None:
            self._heartbeat = heartbeat

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Block until the consumer has its partitions (useful before the first step)."""
        return self._ready.wait(timeout)

    def poll(self, step: int | None = None) -> list[AppliedAction]:
        """Apply every action that arrived since the last call; returns what was done."""
        results = []
        while True:
            action = self._next_nowait()
            if action is None:
                break
            result = self._apply(action, step)
            if result is not None:
                results.append(result)
                if action.kind == "stop":
                    if self._stop_exit_after_s is not None:
                        self.stop_deadline(self._stop_exit_after_s)
                    break
        return results

    def stop_deadline(self, timeout_s: float, exit_code: int | None = None) -> threading.Thread:
        """Hard-exit fallback after a stop: a daemon thread calls ``os._exit(exit_code)`` unless the
        process has exited within ``timeout_s`` (a graceful exit ends the thread with the process)
        or :meth:`disarm_stop_deadline` was called."""
        code = self._stop_exit_code if exit_code is None else exit_code
        self._watchdog_disarmed.clear()

        def watchdog() -> None:
            if self._watchdog_disarmed.wait(timeout_s):
                return
            msg = f"runwatch: still running {timeout_s:g} s after a stop action; exiting with code {code}\n"
            try:
                sys.stderr.write(msg)
                sys.stderr.flush()
            finally:
                os._exit(code)

        thread = threading.Thread(target=watchdog, name="runwatch-stop-watchdog", daemon=True)
        thread.start()
        return thread

    def disarm_stop_deadline(self) -> None:
        self._watchdog_disarmed.set()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _next_nowait(self) -> Action | None:
        if self._deferred:
            return self._deferred.popleft()
        try:
            return self._accepted.get_nowait()
        except queue.Empty:
            return None

    # -- acting ---------------------------------------------------------------------

    def _apply(self, action: Action, step: int | None) -> AppliedAction | None:
        if action.is_expired(utc_now()):  # it may have waited in the queue
            self.ignored["expired"] += 1
            return None
        if action.kind == "rollback":
            result = self._rollback(action, step)
        elif action.kind == "pause":
            result = self._pause(action, step)
        elif action.kind == "resume":
            ended = self._ended_pause.pop(action.action_id, None)
            result = AppliedAction(action, "applied", from_step=step,
                                   detail=f"ended pause {ended}" if ended else "not paused")
        else:  # alert, stop: the training loop decides what a stop means for it
            ended = self._ended_pause.pop(action.action_id, None)
            result = AppliedAction(action, "applied", from_step=step, detail=f"ended pause {ended}" if ended else None)
        self.applied.append(result)
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
            return AppliedAction(action, "failed", from_step=step, detail="no registered checkpoint before the onset")
        if self._restore is None:
            return AppliedAction(action, "failed", from_step=step, detail="no model given to restore into")
        try:
            self._restore(ref)
        except Exception as exc:
            return AppliedAction(action, "failed", from_step=step, detail=f"restore failed: {exc!r}")
        detail = f"restored {ref.uri}"
        lr_scale = lr_factor = None
        wanted = action.params.get("lr_scale")
        if wanted is not None and self._optimizer is not None:
            try:
                lr_factor = scale_lr(self._optimizer, float(wanted))
                lr_scale = float(wanted)
                detail += f"; LR x{lr_factor:g} (x{lr_scale:g} of the original)"
            except Exception as exc:  # the restore happened: report it, and that the LR did not change
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
        return AppliedAction(action, "applied", from_step=step, to_step=ref.step, detail=detail,
                             lr_scale=lr_scale, lr_factor=lr_factor, skip_steps=skip)

    def _pause(self, action: Action, step: int | None) -> AppliedAction:
        timeout = float(action.params.get("timeout_s", self._pause_timeout_s))
        started = time.monotonic()
        deadline = started + timeout
        if self._heartbeat is not None:
            self._heartbeat.push("idle")
        try:
            while time.monotonic() < deadline:
                try:
                    nxt = self._accepted.get(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    continue
                self._deferred.append(nxt)  # applied (and acknowledged) after the pause, in order
                if nxt.kind in ("resume", "stop"):
                    self._ended_pause[nxt.action_id] = action.action_id
                    waited = time.monotonic() - started
                    return AppliedAction(action, "applied", from_step=step,
                                         detail=f"paused {waited:.1f} s until {nxt.kind} {nxt.action_id}")
            return AppliedAction(action, "applied", from_step=step,
                                 detail=f"pause timed out after {timeout:g} s; resuming")
        finally:
            if self._heartbeat is not None:
                self._heartbeat.pop()

    # -- background thread ----------------------------------------------------------

    def _accept(self, raw: bytes) -> None:
        try:
            action = decode_action(raw)
        except SchemaError:
            self.ignored["malformed"] += 1
            return
        if action.run_id != self.rw.run_id:
            return  # another run's action on a shared partition: not ours to count
        if not verify_action(action, self._secret):
            self.ignored["bad_signature"] += 1
        elif action.is_expired(utc_now()):
            self.ignored["expired"] += 1
        elif action.issued_at < self._not_before:
            self.ignored["stale"] += 1
        elif action.action_id in self._seen:
            self.ignored["duplicate"] += 1
        else:
            self._seen.add(action.action_id)
            self._accepted.put(action)

    def _consume(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        consumer = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = KafkaConsumer(
                        bootstrap_servers=self.rw.bootstrap,
                        api_version=topics.KAFKA_API_VERSION,
                        enable_auto_commit=False,
                        auto_offset_reset="earliest",
                        fetch_max_wait_ms=20,  # an action should reach the loop within a step or two
                        client_id=f"runwatch-actions-{self.rw.run_id}-r{self.rw.rank}",
                    )
                    partitions = consumer.partitions_for_topic(self._topic) or set()
                    if not partitions:
                        consumer.close()
                        consumer = None
                        self._stop.wait(0.5)
                        continue
                    tps = [TopicPartition(self._topic, p) for p in sorted(partitions)]
                    consumer.assign(tps)
                    # Start at the listener's start time; older actions are not ours to act on.
                    start_ms = int(self._not_before.timestamp() * 1000)
                    for tp, found in consumer.offsets_for_times({tp: start_ms for tp in tps}).items():
                        if found is not None:
                            consumer.seek(tp, found.offset)
                        else:
                            consumer.seek_to_beginning(tp)
                    self._ready.set()
                for records in consumer.poll(timeout_ms=100).values():
                    for record in records:
                        self._accept(record.value)
            except Exception as exc:  # broker down: retry, never raise into training
                log.debug("runwatch: action consumer error: %r", exc)
                if consumer is not None:
                    try:
                        consumer.close()
                    except Exception:
                        pass
                consumer = None
                self._stop.wait(1.0)
        if consumer is not None:
            consumer.close()
