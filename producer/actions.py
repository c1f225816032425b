"""``ActionListener``: the trainer's side of the action topic.

A daemon thread consumes ``runwatch.actions`` and keeps only actions that are
addressed to this run, signed with the shared secret, unexpired, issued neither before the
listener started nor in the future (both with a clock-skew allowance, ``clock_skew_s``) and
neither seen before nor applied before a restart. Everything else is counted in ``ignored``
by reason: ``other_run``, ``malformed``, ``bad_signature``, ``future``, ``expired``,
``stale``, ``duplicate`` (delivered again to this listener), ``already_applied`` (handled
before the trainer restarted, or by another rank, see below). Training code calls
:meth:`poll` once per step; it never waits on the network (except while paused, which is
the point of a pause).

Applied action ids survive a restart: the id of every action this rank acknowledged (applied
or failed) is written to a small per-rank state file, by default beside the rank's spool
directory, ``$RUNWATCH_SPOOL_DIR/<run_id>-r<rank>.actions`` (``state_path=`` chooses another
file, one per rank; ``state_path=False`` keeps nothing). It is rewritten atomically (temporary
file, fsync, rename) before the acknowledgement is sent and keeps the newest
``state_max_ids`` ids. A listener started with the file loads it, so an action redelivered to
a restarted trainer (which the start-time allowance would accept) is not applied twice.

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
  With ``stop_exit_after_s`` a watchdog ends the process with ``os._exit(stop_exit_code)`` if it
  is still alive that long after the stop was *received*: it is armed by the consumer thread on
  receipt, since a rank blocked in a collective or hung elsewhere never reaches ``poll``.
  :meth:`ActionListener.stop_deadline` arms the same watchdog by hand; arming it again keeps one
  watchdog, with the earlier deadline.

Several ranks (``sync``, on by default when torch.distributed runs with more than one rank):
each rank's consumer receives an action at its own moment, so left alone one rank could roll
back a step before another, with a different checkpoint. Instead rank 0 leads: at each ``poll``
it broadcasts how many actions it is about to apply (one small tensor per poll) and, only when
there are some, their ids; every other rank waits (up to ``sync_timeout_s``) until its own
consumer has accepted those ids and applies exactly those, in rank 0's order. So every rank
rolls back at the same ``poll`` (the same step) to the same checkpoint. Actions a rank received
that rank 0 has not announced wait for a later poll; one that does not arrive in time is applied
from rank 0's copy (broadcast with the ids, and verified with the secret here), so no rank diverges
and none hangs; a copy that does not verify is acked ``failed``. The broadcasts run on a gloo group of their own, so this
works under NCCL too; creating it is collective: every rank must construct its listener at the
same point, and with ``sync`` on ``poll`` is a collective too: every rank calls it equally often
(once per step). A pause is applied by every rank at the same poll; each rank's pause then ends
when its own consumer sees the resume (or stop) or its timeout passes, so the ranks resume within
a consumer's delay of each other and meet at the next collective; the resume itself is announced
and acknowledged like any action. When rank 0 announces actions, the ranks also agree (one small
all-reduce) on which of them some rank already applied before a restart (its state file has the
id): those are applied by no rank and counted ``already_applied``, so no rank applies an action
twice, none waits for it, and the ranks stay in step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from runwatch.producer.lr import LR_SCALE_KEY as LR_SCALE_KEY  # re-exported: where callers found it
from runwatch.producer.lr import scale_lr
from runwatch.producer.publisher import RunWatch, default_spool_dir
from runwatch.producer.wire import topics
from runwatch.producer.wire.schema import (
    Action,
    CheckpointRef,
    SchemaError,
    decode_action,
    newest_checkpoint_before,
    utc_now,
)
from runwatch.producer.wire.signing import resolve_secret, verify_action

log = logging.getLogger(__name__)

RestoreFn = Callable[[CheckpointRef], None]
STATE_SUFFIX = ".actions"
STATE_MAX_IDS = 10_000  # applied action ids kept in the state file (the newest)


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


def save_checkpoint(path: str, model: Any, optimizer: Any = None, **extra: Any) -> None:
    """Write a checkpoint in the layout the default rollback restores."""
    import torch

    state = {"model": model.state_dict(), **extra}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    torch.save(state, path)


def default_state_path(rw: Any) -> Path:
    """Where a listener keeps the ids of the actions it applied: beside the rank's spool directory
    (``rw.spool_path``, else :func:`~runwatch.producer.publisher.default_spool_dir`), with
    ``.actions`` appended to its name."""
    spool = getattr(rw, "spool_path", None)
    base = Path(spool) if spool is not None else default_spool_dir(rw.run_id, rw.rank)
    return base.with_name(base.name + STATE_SUFFIX)


class AppliedIds:
    """The ids of the actions a rank acknowledged, newest last, kept in a JSON file that is
    rewritten atomically (temporary file, fsync, rename) and bounded to the newest ``max_ids``.
    ``path=None``: in memory only. Never raises into training: a file that cannot be read or
    written is logged (and ``errors`` counts it), and the listener goes on without it."""

    def __init__(self, path: str | os.PathLike[str] | None, max_ids: int = STATE_MAX_IDS, *,
                 run_id: str = "", rank: int = 0):
        if max_ids < 1:
            raise ValueError(f"state_max_ids must be at least 1, got {max_ids}")
        self.path = Path(path).resolve() if path is not None else None
        self.max_ids = max_ids
        self.errors = 0
        self._run_id, self._rank = run_id, rank
        self._ids: dict[str, None] = {}  # insertion-ordered: oldest first
        self._lock = threading.Lock()
        self.loaded = self._load()

    def __contains__(self, action_id: object) -> bool:
        with self._lock:
            return action_id in self._ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def add(self, *action_ids: str) -> None:
        """Remember ``action_ids`` and write the file before returning."""
        with self._lock:
            for action_id in action_ids:
                self._ids.pop(action_id, None)
                self._ids[action_id] = None
            while len(self._ids) > self.max_ids:
                del self._ids[next(iter(self._ids))]
            self._write()

    def _load(self) -> int:
        if self.path is None:
            return 0
        try:
            data = json.loads(self.path.read_bytes())
            ids = data["applied"]
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                raise ValueError("'applied' is not a list of strings")
        except FileNotFoundError:
            return 0
        except Exception as exc:
            self.errors += 1
            log.warning("runwatch: cannot read the applied actions in %s (%r); starting without them",
                        self.path, exc)
            return 0
        for action_id in ids[-self.max_ids:]:
            self._ids[action_id] = None
        return len(self._ids)

    def _write(self) -> None:
        if self.path is None:
            return
        body = json.dumps({"run_id": self._run_id, "rank": self._rank, "applied": list(self._ids)}).encode()
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            with contextlib.suppress(OSError):  # the rename itself survives a crash too
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except Exception as exc:
            self.errors += 1
            log.warning("runwatch: cannot write the applied actions to %s (%r); a restarted trainer may "
                        "apply them again", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()


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
        sync: bool | str = "auto",
        sync_timeout_s: float = 30.0,
        state_path: str | os.PathLike[str] | bool | None = None,
        state_max_ids: int = STATE_MAX_IDS,
    ):
        """``sync``: apply actions at the same poll on every rank (see the module doc): True, False,
        or "auto" (on when torch.distributed is initialised with more than one rank). Construct the
        listener at the same point on every rank when it is on. ``sync_timeout_s``: how long a
        rank waits for an action rank 0 announced before it gives that action up as failed.

        ``clock_skew_s``: how far before the listener's start and how far in the future an
        action's ``issued_at`` may lie. ``state_path``: the file that keeps the ids of the actions
        this rank applied, across restarts (None: :func:`default_state_path`; False: none; give each
        rank its own), bounded to the newest ``state_max_ids``."""
        self.rw = rw
        self._secret = resolve_secret(secret)
        if restore is None and model is not None:
            restore = torch_restore(model, optimizer)
        self._restore = restore
        self._optimizer = optimizer
        if optimizer is not None and hasattr(rw, "track_lr"):
            rw.track_lr(optimizer)  # checkpoints record the LR a rollback scales
        self._heartbeat = heartbeat
        self._clock_skew = timedelta(seconds=clock_skew_s)
        self._not_before = utc_now() - self._clock_skew
        self._pause_timeout_s = pause_timeout_s
        self._stop_exit_after_s = stop_exit_after_s
        self._stop_exit_code = stop_exit_code
        self._watchdog_lock = threading.Condition()
        self._watchdog: threading.Thread | None = None
        self._watchdog_disarmed = threading.Event()
        self._watchdog_deadline = 0.0
        self._watchdog_code = stop_exit_code
        self._watchdog_timeout_s = 0.0
        self._topic = topic
        self._accepted: queue.Queue[Action] = queue.Queue()
        # Taken from the queue, not applied yet, in arrival order, with an arrival number: actions that
        # came during a pause (applied after it), and on a rank other than 0, actions rank 0 has not
        # announced yet.
        self._pending: dict[str, tuple[int, Action]] = {}
        self._arrivals = 0
        self._taken_seq: dict[str, int] = {}  # arrival number of each action taken to apply, until applied
        self._given_up: set[str] = set()  # announced ids this rank stopped waiting for
        self._ended_pause: dict[str, str] = {}  # resume/stop action id -> the pause it ended
        self._seen: set[str] = set()
        if state_path is True:
            state_path = None
        path = None if state_path is False else (default_state_path(rw) if state_path is None else state_path)
        # Acknowledged here, in this process or before a restart: never applied again.
        self.applied_ids = AppliedIds(path, state_max_ids, run_id=rw.run_id, rank=rw.rank)
        self._sync_timeout_s = sync_timeout_s
        self._sync_group: Any = None
        self.sync_leader = True  # rank 0, or no sync: decides what to apply on its own
        self._setup_sync(sync)
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
        if optimizer is not None and hasattr(self.rw, "track_lr"):
            self.rw.track_lr(optimizer)
        if heartbeat is not None:
            self._heartbeat = heartbeat

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Block until the consumer has its partitions (useful before the first step)."""
        return self._ready.wait(timeout)

    @property
    def synced(self) -> bool:
        """Whether actions are applied in step with the other ranks (see the module doc)."""
        return self._sync_group is not None

    def poll(self, step: int | None = None) -> list[AppliedAction]:
        """Apply every action that arrived since the last call; returns what was done.

        With ``sync`` on this is a collective: every rank calls it, equally often."""
        if self._sync_group is not None:
            return self._poll_synced(step)
        results = []
        while True:
            action = self._next_nowait()
            if action is None:
                break
            result = self._apply(action, step)
            if result is not None:
                results.append(result)
                if action.kind == "stop":
                    self._arm_on_stop()
                    break
        return results

    def stop_deadline(self, timeout_s: float, exit_code: int | None = None) -> threading.Thread:
        """Hard-exit fallback after a stop: a daemon thread calls ``os._exit(exit_code)`` unless the
        process has exited within ``timeout_s`` (a graceful exit ends the thread with the process)
        or :meth:`disarm_stop_deadline` was called. Armed already: the one watchdog keeps the
        earlier deadline (and its exit code); no second one is started."""
        code = self._stop_exit_code if exit_code is None else exit_code
        deadline = time.monotonic() + timeout_s
        with self._watchdog_lock:
            thread = self._watchdog
            if thread is not None and thread.is_alive() and not self._watchdog_disarmed.is_set():
                if deadline < self._watchdog_deadline:
                    self._watchdog_deadline, self._watchdog_code, self._watchdog_timeout_s = deadline, code, timeout_s
                    self._watchdog_lock.notify_all()
                return thread
            self._watchdog_disarmed = disarmed = threading.Event()
            self._watchdog_deadline, self._watchdog_code, self._watchdog_timeout_s = deadline, code, timeout_s
            thread = threading.Thread(target=self._watchdog_run, args=(disarmed,), name="runwatch-stop-watchdog",
                                      daemon=True)
            self._watchdog = thread
            thread.start()
            return thread

    def disarm_stop_deadline(self) -> None:
        with self._watchdog_lock:
            self._watchdog_disarmed.set()
            self._watchdog_lock.notify_all()

    def _watchdog_run(self, disarmed: threading.Event) -> None:
        with self._watchdog_lock:
            while True:
                if disarmed.is_set():
                    return
                remaining = self._watchdog_deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._watchdog_lock.wait(remaining)
            code, timeout_s = self._watchdog_code, self._watchdog_timeout_s
        msg = f"runwatch: still running {timeout_s:g} s after a stop action; exiting with code {code}\n"
        try:
            sys.stderr.write(msg)
            sys.stderr.flush()
        finally:
            os._exit(code)

    def _arm_on_stop(self) -> None:
        if self._stop_exit_after_s is not None:
            self.stop_deadline(self._stop_exit_after_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _next_nowait(self) -> Action | None:
        while not self._pending:
            if not self._pull():
                return None
        return self._take(next(iter(self._pending)))

    def _take(self, action_id: str) -> Action | None:
        """Take ``action_id`` out of ``_pending`` to apply it, noting its arrival number (for a pause)."""
        entry = self._pending.pop(action_id, None)
        if entry is None:
            return None
        self._taken_seq[action_id] = entry[0]
        return entry[1]

    def _pull(self, timeout: float | None = None) -> bool:
        """Move one action from the consumer's queue to ``_pending`` (waiting up to ``timeout``);
        False if the queue stayed empty."""
        try:
            action = self._accepted.get(timeout=timeout) if timeout else self._accepted.get_nowait()
        except queue.Empty:
            return False
        if action.action_id in self._given_up:  # given up on this rank once: never applied here
            pass
        elif action.action_id in self.applied_ids:  # dropped by the ranks (see _drop_applied) while it was queued
            self.ignored["already_applied"] += 1
        else:
            self._arrivals += 1
            self._pending[action.action_id] = (self._arrivals, action)
        return True

    # -- applying in step with the other ranks ----------------------------------------

    def _setup_sync(self, sync: bool | str) -> None:
        if sync not in (True, False, "auto"):
            raise ValueError(f"sync must be True, False or 'auto', got {sync!r}")
        if sync is False:
            return
        if sync == "auto" and "torch.distributed" not in sys.modules:
            return  # nothing imported torch.distributed, so no process group is running
        try:
            import torch.distributed as dist

            running = dist.is_available() and dist.is_initialized()
        except ImportError:
            running = False
        if not running:
            if sync is True:
                raise ValueError("sync=True needs torch.distributed initialised (init_process_group) first")
            return
        if dist.get_world_size() <= 1:
            return
        # Collective: every rank creates its listener at the same point. gloo, so that the small
        # broadcasts work on CPU tensors whatever backend the training itself uses (NCCL).
        self._sync_group = dist.new_group(backend="gloo")
        self.sync_leader = dist.get_rank() == 0

    def _poll_synced(self, step: int | None) -> list[AppliedAction]:
        results: list[AppliedAction] = []
        while True:  # rounds: what arrives during a pause is announced in the next round of this poll
            if self._sync_group is None:  # the broadcast failed in an earlier round: on our own from here
                return results + self.poll(step)
            batch: list[Action | tuple[str, bytes]]
            if self.sync_leader:
                batch = list(self._leader_batch())
                announced = self._announce([(a.action_id, a.to_json()) for a in batch])
                if announced is not None:  # None: the group failed; all of it is applied here
                    keep = {action_id for action_id, _ in announced}
                    batch = [a for a in batch if a.action_id in keep]
            else:
                announced = self._announce(None)
                if announced is None:
                    continue
                batch = self._await(announced)
            if not batch:
                return results
            for item in batch:
                if isinstance(item, tuple):
                    result = self._give_up(item, step)
                else:
                    result = self._apply(item, step, check_expiry=False)  # rank 0 checked: all ranks agree
                if result is not None:
                    results.append(result)
                    if result.kind == "stop":
                        self._arm_on_stop()
                        return results

    def _leader_batch(self) -> list[Action]:
        """Rank 0's actions for this round: everything received, up to and including a stop."""
        while self._pull():
            pass
        batch = []
        while self._pending:
            action = self._next_nowait()
            if action is None:
                break
            if action.is_expired(utc_now()):
                self.ignored["expired"] += 1
                continue
            batch.append(action)
            if action.kind == "stop":
                break
        return batch

    def _announce(self, payload: list[tuple[str, bytes]] | None) -> list[tuple[str, bytes]] | None:
        """Rank 0 sends ``payload`` (ids and signed bodies), the others receive it; None if the group failed.
        Then every rank says which of those it already applied (before a restart): what any rank
        applied is dropped everywhere (see :meth:`_drop_applied`), and the rest is returned."""
        import torch
        import torch.distributed as dist

        # A rank that waits here for a peer (one that is slow, or hung before its poll) is in sync.
        waiting = getattr(self._heartbeat, "waiting_for_peers", None)
        try:
            with waiting() if waiting is not None else contextlib.nullcontext():
                count = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
                dist.broadcast(count, src=0, group=self._sync_group)
                if int(count.item()) == 0:
                    return []
                box: list[Any] = [payload]
                dist.broadcast_object_list(box, src=0, group=self._sync_group)
                announced = list(box[0])
                done = torch.tensor([int(action_id in self.applied_ids) for action_id, _ in announced],
                                    dtype=torch.int64)
                dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self._sync_group)
        except Exception as exc:
            log.error("runwatch: the action listeners' broadcast failed (%r); this rank applies actions on its "
                      "own from now on", exc)
            self._sync_group = None
            return None
        return self._drop_applied(announced, [bool(flag) for flag in done.tolist()])

    def _drop_applied(self, announced: list[tuple[str, bytes]], done: list[bool]) -> list[tuple[str, bytes]]:
        """Drop the announced actions that some rank already applied (``done``): counted
        ``already_applied`` where this rank holds a copy, remembered as handled, so that a copy
        arriving later is refused on arrival and no rank waits for one."""
        dropped = [action_id for (action_id, _), flag in zip(announced, done, strict=True) if flag]
        if not dropped:
            return announced
        for action_id in dropped:
            held = self._pending.pop(action_id, None) is not None or self.sync_leader  # rank 0 took it already
            self._taken_seq.pop(action_id, None)
            if held and action_id not in self.applied_ids:  # one that is there was counted on arrival
                self.ignored["already_applied"] += 1
        self.applied_ids.add(*(i for i in dropped if i not in self.applied_ids))
        log.info("runwatch: not applying %d action(s) that a rank applied before a restart: %s", len(dropped),
                 ", ".join(dropped))
        return [item for item, flag in zip(announced, done, strict=True) if not flag]

    def _await(self, announced: list[tuple[str, bytes]]) -> list[Action | tuple[str, bytes]]:
        """The announced actions from this rank's own consumer, in rank 0's order; an (id, body)
        pair for each that did not arrive within ``sync_timeout_s``."""
        deadline = time.monotonic() + self._sync_timeout_s
        while self._pull():
            pass
        out: list[Action | tuple[str, bytes]] = []
        for action_id, body in announced:
            while action_id not in self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._pull(timeout=min(0.05, remaining))
            action = self._take(action_id)
            out.append(action if action is not None else (action_id, body))
        return out

    def _give_up(self, item: tuple[str, bytes], step: int | None) -> AppliedAction | None:
        action_id, body = item
        self._given_up.add(action_id)
        self._seen.add(action_id)  # a late copy is a duplicate, not a new action
        try:
            action = decode_action(body)  # rank 0's copy
        except SchemaError:
            self.ignored["malformed"] += 1
            return None
        if action.run_id == self.rw.run_id and verify_action(action, self._secret):
            # Signed with our secret for our run: apply rank 0's copy, so that this rank does not
            # diverge from the others (a rank that skips a rollback trains on different weights).
            return self._apply(action, step, check_expiry=False)
        detail = (f"rank 0 applied it, but this rank's consumer had not received it {self._sync_timeout_s:g} s "
                  "after rank 0 announced it, and rank 0's copy does not verify here; not applied")
        return self._record(AppliedAction(action, "failed", from_step=step, detail=detail), step)

    # -- acting ---------------------------------------------------------------------

    def _apply(self, action: Action, step: int | None, check_expiry: bool = True) -> AppliedAction | None:
        try:
            return self._apply_now(action, step, check_expiry)
        finally:
            self._taken_seq.pop(action.action_id, None)

    def _apply_now(self, action: Action, step: int | None, check_expiry: bool) -> AppliedAction | None:
        if check_expiry and action.is_expired(utc_now()):  # it may have waited in the queue
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
            if action.kind == "stop" and hasattr(self.rw, "note_stop"):
                self.rw.note_stop(action)  # run_end then says "stopped", with this action's id and cause
        return self._record(result, step)

    def _record(self, result: AppliedAction, step: int | None) -> AppliedAction:
        action = result.action
        self.applied.append(result)
        self.applied_ids.add(action.action_id)  # on disk before the ack: a restart never applies it again
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
                # The run's own LR before the fault: recorded with the checkpoint (or at the start),
                # not the LR in the restored optimizer state, which may be the fault itself.
                base = ref.lr if ref.lr is not None else getattr(self.rw, "initial_lr", None)
                lr_factor = scale_lr(self._optimizer, float(wanted), base)
                lr_scale = float(wanted)
                detail += f"; LR x{lr_factor:g} (x{lr_scale:g} of the run's LR before the fault)"
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
        after = self._taken_seq.get(action.action_id, self._arrivals)  # only what arrived after the pause ends it
        if self._heartbeat is not None:
            self._heartbeat.push("idle")
        try:
            while True:
                # Arrivals stay in _pending: applied (and acknowledged) after the pause, in order.
                ender = self._pause_ender(after)
                if ender is not None:
                    self._ended_pause[ender.action_id] = action.action_id
                    waited = time.monotonic() - started
                    return AppliedAction(action, "applied", from_step=step,
                                         detail=f"paused {waited:.1f} s until {ender.kind} {ender.action_id}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return AppliedAction(action, "applied", from_step=step,
                                         detail=f"pause timed out after {timeout:g} s; resuming")
                self._pull(timeout=min(0.1, remaining))
        finally:
            if self._heartbeat is not None:
                self._heartbeat.pop()

    def _pause_ender(self, after: int) -> Action | None:
        """The first resume or stop that arrived after arrival number ``after`` with no other pause
        before it (a later pause is ended by what follows it)."""
        for seq, pending in self._pending.values():
            if seq <= after:
                continue
            if pending.kind == "pause":
                return None
            if pending.kind in ("resume", "stop"):
                return pending
        return None

    # -- background thread ----------------------------------------------------------

    def _accept(self, raw: bytes) -> None:
        try:
            reason = self._judge(raw)
        except Exception as exc:  # whatever a message holds, the consumer goes on with the next one
            log.debug("runwatch: cannot judge an action: %r", exc)
            reason = "malformed"
        if reason is not None:
            self.ignored[reason] += 1

    def _judge(self, raw: bytes) -> str | None:
        """Why the action in ``raw`` is ignored, or None once it is accepted (queued for poll)."""
        try:
            action = decode_action(raw)
        except SchemaError:
            return "malformed"
        if action.run_id != self.rw.run_id:
            return "other_run"  # another run's action on a shared partition
        now = utc_now()
        if not verify_action(action, self._secret):
            return "bad_signature"
        if action.issued_at > now + self._clock_skew:
            return "future"  # signed, but not issued yet by our clock: never take it on trust
        if action.is_expired(now):
            return "expired"
        if action.issued_at < self._not_before:
            return "stale"
        if action.action_id in self._seen:
            return "duplicate"
        if action.action_id in self.applied_ids:
            return "already_applied"  # before a restart (a copy in this process is a duplicate)
        self._seen.add(action.action_id)
        if action.kind == "stop":
            # Armed on receipt: a rank blocked in a collective or hung never reaches poll().
            self._arm_on_stop()
        self._accepted.put(action)
        return None

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
