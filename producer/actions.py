"""``ActionListener``: the trainer's side of the action topic.

A daemon thread consumes ``runwatch.actions`` and keeps only actions that are
signed with the shared secret, addressed to this run, unexpired, issued after the
listener started (minus a clock-skew allowance) and not seen before. Everything else
is counted in ``ignored`` by reason. Training code calls :meth:`poll` once per step;
it never waits on the network (except while paused, which is the point of a pause).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
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


@dataclass(frozen=True)
class AppliedAction:
    """What :meth:`ActionListener.poll` tells the training loop."""

    action: Action
    outcome: str  # applied | failed
    from_step: int | None = None
    to_step: int | None = None  # for a rollback: the step of the restored checkpoint
    detail: str | None = None

    @property
    def kind(self) -> str:
        return self.action.kind


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
        topic: str = topics.ACTIONS,
    ):
        self.rw = rw
        self._secret = resolve_secret(secret)
        if restore is None and model is not None:
            restore = torch_restore(model, optimizer)
        self._restore = restore
        self._not_before = utc_now() - timedelta(seconds=clock_skew_s)
        self._pause_timeout_s = pause_timeout_s
        self._topic = topic
        self._accepted: queue.Queue[Action] = queue.Queue()
        self._seen: set[str] = set()
        self.ignored: Counter[str] = Counter()
        self.applied: list[AppliedAction] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._consume, name="runwatch-actions", daemon=True)
        self._thread.start()

    # -- what training code calls -------------------------------------------------

    def attach(self, model: Any, optimizer: Any = None, restore: RestoreFn | None = None) -> None:
        """Set what a rollback restores into, for listeners created before the model."""
        self._restore = restore or torch_restore(model, optimizer)

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Block until the consumer has its partitions (useful before the first step)."""
        return self._ready.wait(timeout)

    def poll(self, step: int | None = None) -> list[AppliedAction]:
        """Apply every action that arrived since the last call; returns what was done."""
        results = []
        while True:
            try:
                action = self._accepted.get_nowait()
            except queue.Empty:
                break
            result = self._apply(action, step)
            if result is not None:
                results.append(result)
                if action.kind == "stop":
                    break
        return results

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

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
            result = AppliedAction(action, "applied", from_step=step, detail="not paused")
        else:  # alert, stop: the training loop decides what a stop means for it
            result = AppliedAction(action, "applied", from_step=step)
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
        checkpoint strictly before the anomaly's onset."""
        registered = self.rw.checkpoints
        target = action.target_checkpoint
        if target is not None and any(c.step == target.step and c.uri == target.uri for c in registered):
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
        return AppliedAction(action, "applied", from_step=step, to_step=ref.step, detail=ref.uri)

    def _pause(self, action: Action, step: int | None) -> AppliedAction:
        timeout = float(action.params.get("timeout_s", self._pause_timeout_s))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                nxt = self._accepted.get(timeout=0.1)
            except queue.Empty:
                continue
            if nxt.kind in ("resume", "stop"):
                if nxt.kind == "stop":  # hand the stop back to the loop after this pause ends
                    self._accepted.put(nxt)
                return AppliedAction(action, "applied", from_step=step, detail=f"paused until {nxt.kind}")
        return AppliedAction(action, "applied", from_step=step, detail="pause timed out; resuming")

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
                        client_id=f"runwatch-actions-{self.rw.run_id}",
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
