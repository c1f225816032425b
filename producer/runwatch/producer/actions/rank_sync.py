"""Applying actions in step across ranks (torch.distributed).

Each rank's consumer receives an action at its own moment, so left alone one rank could roll back
a step before another, with a different checkpoint. Instead rank 0 leads: at each ``poll`` it
broadcasts how many actions it is about to apply (one small tensor per poll) and, only when there
are some, their ids and signed bodies; every other rank waits (up to ``sync_timeout_s``) until its
own consumer has accepted those ids and applies exactly those, in rank 0's order. A rank that reads no
action topic (one rank per node does, when ``LOCAL_RANK`` says which: stop_relay.py) applies rank 0's
copies, each verified with the workers' public key, at once. So every rank
rolls back at the same ``poll`` (the same step) to the same checkpoint. Actions a rank received
that rank 0 has not announced wait for a later poll; one that does not arrive in time is applied
from rank 0's copy (verified with the secret here), so no rank diverges and none hangs; a copy
that does not verify is acked ``failed``.

The broadcasts run on a gloo group of their own, so this works under NCCL too; creating it is
collective: every rank must construct its listener at the same point, and ``poll`` is a collective
too: every rank calls it equally often (once per step). A pause is applied by every rank at the
same poll; each rank's pause then ends when its own consumer sees the resume (or stop) or its
timeout passes, so the ranks resume within a consumer's delay of each other and meet at the next
collective; the resume itself is announced and acknowledged like any action. When rank 0
announces actions, the ranks also agree (one small all-reduce) on which of them some rank already
applied before a restart (its state file has the id): those are applied by no rank and counted
``already_applied``, so no rank applies an action twice, none waits for it, and the ranks stay in
step. If a broadcast fails, the rank applies actions on its own from then on.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections import Counter
from typing import Any

from runwatch.contract.action_kinds import applies
from runwatch.contract.schema import Action, utc_now
from runwatch.producer.actions.applied_ids import AppliedIds
from runwatch.producer.actions.arrivals import Arrivals

log = logging.getLogger(__name__)

Announced = list[tuple[str, bytes]]  # (action id, signed body) in rank 0's order


def sync_group(sync: bool | str) -> tuple[Any, bool]:
    """The gloo group the ranks' listeners agree on (None: no sync) and whether this rank leads.
    ``sync``: True, False or "auto" (on when torch.distributed runs with more than one rank).
    Collective when it makes a group: every rank calls it at the same point."""
    if sync not in (True, False, "auto"):
        raise ValueError(f"sync must be True, False or 'auto', got {sync!r}")
    if sync is False:
        return None, True
    if sync == "auto" and "torch.distributed" not in sys.modules:
        return None, True  # nothing imported torch.distributed, so no process group is running
    try:
        import torch.distributed as dist

        running = dist.is_available() and dist.is_initialized()
    except ImportError:
        running = False
    if not running:
        if sync is True:
            raise ValueError("sync=True needs torch.distributed initialised (init_process_group) first")
        return None, True
    if dist.get_world_size() <= 1:
        return None, True
    # gloo, so that the small broadcasts work on CPU tensors whatever backend the training itself uses (NCCL).
    return dist.new_group(backend="gloo"), dist.get_rank() == 0


class RankSync:
    """One round of agreement per call of :meth:`next_batch`; see the module docstring."""

    def __init__(
        self,
        group: Any,
        leader: bool,
        arrivals: Arrivals,
        applied_ids: AppliedIds,
        ignored: Counter[str],
        *,
        timeout_s: float,
        heartbeat: Any = None,
        own_consumer: bool = True,
    ):
        self.group = group
        self.leader = leader
        # False: this rank reads no action topic (its node's reader does: stop_relay.py); it applies
        # rank 0's copies, verified here, at once
        self.own_consumer = own_consumer
        self.heartbeat = heartbeat
        self._arrivals = arrivals
        self._applied_ids = applied_ids
        self._ignored = ignored
        self._timeout_s = timeout_s

    @property
    def active(self) -> bool:
        return self.group is not None

    def next_batch(self) -> list[Action | tuple[str, bytes]] | None:
        """The actions every rank applies now, in rank 0's order; an (id, rank 0's body) pair for one
        this rank did not receive in time. None: the broadcast failed on a rank other than 0 (the
        group is gone; the caller goes on alone). Rank 0 applies its whole batch when it fails."""
        if self.leader:
            batch = self._leader_batch()
            announced = self._announce([(a.action_id, a.to_json()) for a in batch])
            if announced is None:  # the group failed: all of it is applied here
                return list(batch)
            keep = {action_id for action_id, _ in announced}
            return [a for a in batch if a.action_id in keep]
        announced = self._announce(None)
        if announced is None:
            return None
        return self._await(announced)

    def _leader_batch(self) -> list[Action]:
        """Rank 0's actions for this round: everything received, up to and including a stop."""
        self._arrivals.pull_all()
        batch = []
        while self._arrivals.pending:
            action = self._arrivals.next_nowait()
            if action is None:
                break
            if action.is_expired(action.issuer_now(utc_now(), 0)):  # (rank 0's clock: it decides)
                self._ignored["expired"] += 1
                continue
            batch.append(action)
            if applies(action.kind) == "stop":
                break
        return batch

    def _announce(self, payload: Announced | None) -> Announced | None:
        """Rank 0 sends ``payload`` (ids and signed bodies), the others receive it; None if the group failed.
        Then every rank says which of those it already applied (before a restart): what any rank
        applied is dropped everywhere (see :meth:`_drop_applied`), and the rest is returned."""
        import torch
        import torch.distributed as dist

        # A rank that waits here for a peer (one that is slow, or hung before its poll) is in sync.
        waiting = getattr(self.heartbeat, "waiting_for_peers", None)
        try:
            with waiting() if waiting is not None else contextlib.nullcontext():
                count = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
                dist.broadcast(count, src=0, group=self.group)
                if int(count.item()) == 0:
                    return []
                box: list[Any] = [payload]
                dist.broadcast_object_list(box, src=0, group=self.group)
                announced = list(box[0])
                done = torch.tensor(
                    [int(action_id in self._applied_ids) for action_id, _ in announced], dtype=torch.int64
                )
                dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as exc:  # noqa: BLE001 - torch.distributed fails in many ways: go on alone
            log.error(
                "runwatch: the action listeners' broadcast failed (%r); this rank applies actions on its "
                "own from now on",
                exc,
            )
            self.group = None
            return None
        return self._drop_applied(announced, [bool(flag) for flag in done.tolist()])

    def _drop_applied(self, announced: Announced, done: list[bool]) -> Announced:
        """Drop the announced actions that some rank already applied (``done``): counted
        ``already_applied`` where this rank holds a copy, remembered as handled, so that a copy
        arriving later is refused on arrival and no rank waits for one."""
        dropped = [action_id for (action_id, _), flag in zip(announced, done, strict=True) if flag]
        if not dropped:
            return announced
        for action_id in dropped:
            held = self._arrivals.discard(action_id) or self.leader  # rank 0 took it already
            if held and action_id not in self._applied_ids:  # one that is there was counted on arrival
                self._ignored["already_applied"] += 1
        self._applied_ids.add(*(i for i in dropped if i not in self._applied_ids))
        log.info(
            "runwatch: not applying %d action(s) that a rank applied before a restart: %s",
            len(dropped),
            ", ".join(dropped),
        )
        return [item for item, flag in zip(announced, done, strict=True) if not flag]

    def _await(self, announced: Announced) -> list[Action | tuple[str, bytes]]:
        """The announced actions from this rank's own consumer, in rank 0's order; an (id, body)
        pair for each that did not arrive within the timeout."""
        if not self.own_consumer:
            return list(announced)
        deadline = time.monotonic() + self._timeout_s
        self._arrivals.pull_all()
        out: list[Action | tuple[str, bytes]] = []
        for action_id, body in announced:
            while action_id not in self._arrivals.pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._arrivals.pull(timeout=min(0.05, remaining))
            action = self._arrivals.take(action_id)
            out.append(action if action is not None else (action_id, body))
        return out
