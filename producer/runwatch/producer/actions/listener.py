"""``ActionListener``: the trainer's side of the action topic.

A daemon thread (:mod:`~runwatch.producer.actions.reader`) consumes ``runwatch.actions``; its
:mod:`~runwatch.contract.inbox` keeps only actions that are addressed to this run, signed
by the workers' key (verified with their public key: ``$RUNWATCH_ACTION_PUBLIC_KEYS``; a trainer holds
no key that can sign), issued for this attempt of the run (when both name one: ``RunWatch.attempt``),
unexpired, issued neither before the listener started nor in the future (both with a clock-skew
allowance, ``clock_skew_s``) and neither seen before nor applied before a restart. Everything else is
counted in ``ignored`` by reason: ``other_run``, ``malformed``, ``bad_signature``, ``other_attempt``,
``future``, ``expired``, ``stale``, ``duplicate`` (delivered again to this
listener), ``already_applied`` (handled before the trainer restarted, or by another rank). Training
code calls :meth:`ActionListener.poll` once per step; it never waits on the network (except while
paused, which is the point of a pause).

Applied action ids survive a restart (:mod:`~runwatch.producer.actions.applied_ids`). Actions are
per run, not per rank: every rank's listener reads every action of its run (no consumer group),
applies it at its own next :meth:`~ActionListener.poll`
(:mod:`~runwatch.producer.actions.apply`: rollback, pause, resume, stop, alert) and acknowledges
it with its own rank. With several ranks, rank 0 decides what every rank applies at a poll
(:mod:`~runwatch.producer.actions.rank_sync`). With ``stop_exit_after_s`` a watchdog ends a process
that a stop did not end (:mod:`~runwatch.producer.actions.watchdog`); it is armed by the consumer
thread on receipt, since a rank blocked in a collective or hung elsewhere never reaches ``poll``.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from runwatch.contract import topics
from runwatch.contract.action_kinds import applies
from runwatch.contract.inbox import DEFAULT_CLOCK_SKEW, ActionInbox
from runwatch.contract.schema import Action, CheckpointRef, SchemaError, decode_action, utc_now
from runwatch.contract.signing import ActionPublicKeys, MissingKeyError, resolve_public_keys
from runwatch.producer.actions.applied_ids import STATE_MAX_IDS, AppliedIds, default_state_path
from runwatch.producer.actions.apply import ActionApplier, AppliedAction
from runwatch.producer.actions.arrivals import Arrivals
from runwatch.producer.actions.checkpoints import RestoreFn, torch_restore
from runwatch.producer.actions.rank_sync import RankSync, sync_group
from runwatch.producer.actions.reader import ActionReader
from runwatch.producer.actions.stop_relay import StopRelay
from runwatch.producer.actions.watchdog import StopWatchdog

if TYPE_CHECKING:
    from runwatch.producer.publish.publisher import ActionPublisher


log = logging.getLogger(__name__)


def _no_keys() -> ActionPublicKeys:
    """Keys that verify nothing (a listener without public keys refuses every action): one made here, its
    private half dropped at once."""
    from runwatch.contract.signing import ActionSigningKey

    return ActionPublicKeys([ActionSigningKey.generate().public])


def _signer(action: Action | None) -> str:
    """Which key an action names as its signer, for the warning."""
    signature = action.signature if action is not None else ""
    parts = signature.split(":")
    return f"names key {parts[1]!r}" if len(parts) == 3 else "is not an ed25519:<key id>:<signature>"


def _publishes_to_kafka(rw: ActionPublisher) -> bool:
    """Whether ``rw`` sends to a Kafka broker (its actions come back from the same one)."""
    from runwatch.producer.publish.kafka_delivery import KafkaDelivery

    return isinstance(rw.delivery, KafkaDelivery)


class ActionListener:
    def __init__(
        self,
        rw: ActionPublisher,
        model: Any = None,
        optimizer: Any = None,
        *,
        public_keys: str | ActionPublicKeys | None = None,
        restore: RestoreFn | None = None,
        clock_skew_s: float = DEFAULT_CLOCK_SKEW.total_seconds(),
        pause_timeout_s: float = 300.0,
        heartbeat: Any = None,
        stop_exit_after_s: float | None = None,
        stop_exit_code: int = 1,
        topic: str = topics.ACTIONS,
        consume: bool | None = None,
        sync: bool | str = "auto",
        sync_timeout_s: float = 30.0,
        consume_on_every_rank: bool = False,
        state_path: str | os.PathLike[str] | bool | None = None,
        state_max_ids: int = STATE_MAX_IDS,
        strict: bool = False,
    ):
        """``sync``: apply actions at the same poll on every rank (see
        :mod:`~runwatch.producer.actions.rank_sync`): True, False, or "auto" (on when
        torch.distributed is initialised with more than one rank). Construct the listener at the
        same point on every rank when it is on. Under it, when the launcher sets ``LOCAL_RANK``, only one
        rank per node reads the action topic (``LOCAL_RANK`` 0, and rank 0): the others apply rank 0's
        copies, verified with the public key, and a stop their node's reader receives arms their
        watchdog through a node-local marker (stop_relay.py); ``consume_on_every_rank=True``: every rank
        reads it. ``sync_timeout_s``: how long a reading rank waits for an action rank 0 announced
        before it applies rank 0's copy.

        ``clock_skew_s``: how far before the listener's start and how far in the future an
        action's ``issued_at`` may lie. ``state_path``: the file that keeps the ids of the actions
        this rank applied, across restarts (None: :func:`default_state_path`; False: none; give each
        rank its own), bounded to the newest ``state_max_ids``. ``consume``: read the action topic
        from the run's broker in a thread (default: when the run publishes to Kafka; not for a run
        recorded to a file or to memory); False: no consumer thread (tests, another transport), raw
        actions go to ``_accept``.

        ``public_keys``: the workers' public key(s), as ``$RUNWATCH_ACTION_PUBLIC_KEYS`` holds them (the
        default) or parsed; only actions signed by one of them are applied. Without a usable one (none
        given, the variable unset or not public keys) the listener warns once and applies nothing: the run
        goes on, unwatched by actions (``unsigned`` says why). ``strict=True`` raises ``MissingKeyError``
        instead. The first action for this run that fails verification is warned about once: the
        trainer's public keys are not the workers'."""
        self.rw = rw
        self.unsigned: str | None = None  # why no action can be applied in this run, if so
        self.verification_warned = False  # the one warning of an action for this run that fails verification
        keys: ActionPublicKeys | None
        try:
            keys = resolve_public_keys(public_keys)
        except MissingKeyError as exc:
            if strict:
                raise
            self.unsigned = str(exc)
            log.warning("runwatch: %s; actions are not applied in this run", exc)
            keys = None
            consume = False
        self._key_ids = keys.key_ids if keys is not None else []
        if consume is None:
            consume = _publishes_to_kafka(rw)
        if restore is None and model is not None:
            restore = torch_restore(model, optimizer)
        if optimizer is not None:
            rw.track_lr(optimizer)  # checkpoints record the LR a rollback scales
        if state_path is True:
            state_path = None
        path = None if state_path is False else (default_state_path(rw) if state_path is None else state_path)
        # Acknowledged here, in this process or before a restart: never applied again.
        self.applied_ids = AppliedIds(path, state_max_ids, run_id=rw.run_id, rank=rw.rank)
        clock_skew = timedelta(seconds=clock_skew_s)
        started_at = utc_now() - clock_skew
        self._inbox = ActionInbox(
            keys if keys is not None else _no_keys(),
            run_id=rw.run_id,
            attempt=rw.attempt,
            clock_skew=clock_skew,
            not_before=started_at,
            handled=self._handled_before,
            rank=rw.rank,
        )
        self.ignored = self._inbox.ignored
        self._arrivals = Arrivals(self.applied_ids, self.ignored)
        self._applier = ActionApplier(
            rw,
            self._arrivals,
            self.applied_ids,
            self.ignored,
            restore=restore,
            optimizer=optimizer,
            heartbeat=heartbeat,
            pause_timeout_s=pause_timeout_s,
        )
        self.applied: list[AppliedAction] = self._applier.applied
        self.watchdog = StopWatchdog(stop_exit_after_s, stop_exit_code)
        group, leader = sync_group(sync)
        # Under rank sync one rank per node reads the action topic (a consumer per rank is thousands of
        # consumers of one partition on a large job); the node's others get a stop through its relay
        local_rank = os.environ.get("LOCAL_RANK")
        node_reads = group is not None and local_rank is not None and not consume_on_every_rank
        follower = node_reads and not leader and local_rank != "0"
        self._relay = StopRelay(rw.run_id) if node_reads else None
        self._sync = RankSync(
            group,
            leader,
            self._arrivals,
            self.applied_ids,
            self.ignored,
            timeout_s=sync_timeout_s,
            heartbeat=heartbeat,
            own_consumer=not follower,
        )
        self._sync_timeout_s = sync_timeout_s
        self._reader: ActionReader | None = None
        self._reader_args = (rw.bootstrap, topic, started_at, f"runwatch-actions-{rw.run_id}-r{rw.rank}")
        self._consume = bool(consume)
        if consume and not follower:
            self._start_reader()
        elif consume and self._relay is not None:
            self._relay.watch(self.watchdog.arm_on_stop, since=started_at.timestamp())

    # -- what training code calls -------------------------------------------------

    def attach(
        self, model: Any, optimizer: Any = None, restore: RestoreFn | None = None, heartbeat: Any = None
    ) -> None:
        """Set what a rollback restores into (and whose LR it scales), for listeners created
        before the model; ``heartbeat`` (``watch.heartbeat``) reports a pause as idle."""
        self._applier.restore = restore or torch_restore(model, optimizer)
        self._applier.optimizer = optimizer
        if optimizer is not None:
            self.rw.track_lr(optimizer)
        if heartbeat is not None:
            self._applier.heartbeat = self._sync.heartbeat = heartbeat

    def _start_reader(self) -> None:
        bootstrap, topic, started_at, client_id = self._reader_args
        stats = self.rw.delivery.stats
        self._reader = ActionReader(
            bootstrap,
            topic,
            started_at,
            self._accept,
            client_id=client_id,
            key=self.rw.run_id.encode(),
            # (the run publishing: an action may answer its events, so the reader's fetch wait stays short)
            activity=lambda: stats.queued + stats.published,
        )
        self._reader.start()

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Block until the consumer has its partitions (useful before the first step); False at
        once without a consumer (``consume=False``). A rank whose node's reader reads for it: True."""
        if self._reader is None and self._consume and not self._sync.own_consumer:
            return True
        return self._reader is not None and self._reader.ready.wait(timeout)

    @property
    def consuming(self) -> bool:
        """Whether this rank reads the action topic itself (under rank sync, one rank per node does)."""
        return self._reader is not None

    @property
    def synced(self) -> bool:
        """Whether actions are applied in step with the other ranks (see the module doc)."""
        return self._sync.active

    def poll(self, step: int | None = None) -> list[AppliedAction]:
        """Apply every action that arrived since the last call; returns what was done.

        With ``sync`` on this is a collective: every rank calls it, equally often."""
        if self._sync.active:
            return self._poll_synced(step)
        results = []
        while True:
            action = self._arrivals.next_nowait()
            if action is None:
                break
            result = self._applier.apply(action, step)
            if result is not None:
                results.append(result)
                if applies(action.kind) == "stop":
                    self.watchdog.arm_on_stop()
                    break
        return results

    def choose_checkpoint(self, action: Action) -> CheckpointRef | None:
        """The checkpoint a rollback restores (see :meth:`ActionApplier.choose_checkpoint`)."""
        return self._applier.choose_checkpoint(action)

    def stop_deadline(self, timeout_s: float, exit_code: int | None = None) -> threading.Thread:
        """Hard-exit fallback after a stop: a daemon thread calls ``os._exit(exit_code)`` unless the
        process has exited within ``timeout_s`` (a graceful exit ends the thread with the process)
        or :meth:`disarm_stop_deadline` was called. Armed already: the one watchdog keeps the
        earlier deadline (and its exit code); no second one is started."""
        return self.watchdog.arm(timeout_s, exit_code)

    def disarm_stop_deadline(self) -> None:
        self.watchdog.disarm()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._relay is not None:
            self._relay.close()

    # -- applying in step with the other ranks ----------------------------------------

    def _poll_synced(self, step: int | None) -> list[AppliedAction]:
        results: list[AppliedAction] = []
        while True:  # rounds: what arrives during a pause is announced in the next round of this poll
            if not self._sync.active:  # the broadcast failed in an earlier round: on our own from here
                if self._reader is None and self._consume:
                    self._start_reader()  # (a rank its node's reader read for reads for itself now)
                return results + self.poll(step)
            batch = self._sync.next_batch()
            if batch is None:
                continue
            if not batch:
                return results
            for item in batch:
                if isinstance(item, tuple):
                    result = self._apply_rank0_copy(item, step)
                else:
                    # rank 0 checked: all ranks agree
                    result = self._applier.apply(item, step, check_expiry=False)
                if result is not None:
                    results.append(result)
                    if applies(result.kind) == "stop":
                        self.watchdog.arm_on_stop()
                        return results

    def _apply_rank0_copy(self, item: tuple[str, bytes], step: int | None) -> AppliedAction | None:
        """An announced action this rank's consumer did not deliver in time: apply rank 0's copy if it
        verifies here, else acknowledge it ``failed``."""
        action_id, body = item
        self._arrivals.give_up(action_id)
        self._inbox.mark_seen(action_id)  # a late copy is a duplicate, not a new action
        try:
            action = decode_action(body)
        except SchemaError:
            self.ignored["malformed"] += 1
            return None
        if self._inbox.verifies(action):
            # Signed by the workers for our run: apply rank 0's copy, so that this rank does not
            # diverge from the others (a rank that skips a rollback trains on different weights).
            return self._applier.apply(action, step, check_expiry=False)
        detail = (
            f"rank 0 applied it, but this rank's consumer had not received it {self._sync_timeout_s:g} s "
            "after rank 0 announced it, and rank 0's copy does not verify here; not applied"
        )
        return self._applier.record(AppliedAction(action, "failed", from_step=step, detail=detail), step)

    # -- from the consumer thread ------------------------------------------------------

    def _accept(self, raw: bytes | None) -> None:
        verdict = self._inbox.judge(raw)
        if verdict.reason == "bad_signature" and not self.verification_warned:
            # (only this run's actions reach the signature check: another run's are other_run)
            self.verification_warned = True
            log.warning(
                "runwatch: actions for run %s fail verification: is %s the workers' public key? "
                "(this one's signature %s; the keys here: %s; no such action is applied)",
                self.rw.run_id,
                topics.PUBLIC_KEYS_ENV,
                _signer(verdict.action),
                ", ".join(self._key_ids) or "none",
            )
        action = verdict.action if verdict.reason is None else None
        if action is None:
            return
        if applies(action.kind) == "stop":
            # Armed on receipt: a rank blocked in a collective or hung never reaches poll(); so are the
            # watchdogs of the node's ranks that read through this one (stop_relay.py)
            self.watchdog.arm_on_stop()
            if self._relay is not None:
                self._relay.signal(action.action_id)
        self._arrivals.put(action)

    def _handled_before(self, action: Action) -> str | None:
        # Before a restart (a copy in this process is a duplicate), or dropped by the ranks.
        return "already_applied" if action.action_id in self.applied_ids else None
