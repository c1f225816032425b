"""The accepted actions between the listener's consumer thread and the training loop.

The consumer thread ``put``s each admitted action on a queue; the loop ``pull``s them into
``pending``, in arrival order, each with an arrival number, and ``take``s them out to apply them.
Actions stay pending while a pause holds the loop (applied after it, in order) and, on a rank
other than 0, until rank 0 announces them. The arrival number of an action taken to apply is
kept until it is ``done``: a pause is ended only by a resume or stop that arrived after it.
"""

from __future__ import annotations

import queue
from collections import Counter

from runwatch.contract.action_kinds import PAUSE_ENDERS, applies
from runwatch.contract.schema import Action
from runwatch.producer.actions.applied_ids import AppliedIds


class Arrivals:
    def __init__(self, applied_ids: AppliedIds, ignored: Counter[str]):
        self._applied_ids = applied_ids
        self._ignored = ignored
        self._accepted: queue.Queue[Action] = queue.Queue()
        self.pending: dict[
            str, tuple[int, Action]
        ] = {}  # action id -> (arrival number, action), oldest first
        self._count = 0
        self._taken: dict[str, int] = {}  # arrival number of each action taken to apply, until done
        self._given_up: set[str] = set()  # announced ids this rank stopped waiting for

    def put(self, action: Action) -> None:
        """From the consumer thread: an admitted action."""
        self._accepted.put(action)

    def pull(self, timeout: float | None = None) -> bool:
        """Move one action from the consumer's queue to ``pending`` (waiting up to ``timeout``);
        False if the queue stayed empty."""
        try:
            action = self._accepted.get(timeout=timeout) if timeout else self._accepted.get_nowait()
        except queue.Empty:
            return False
        if action.action_id in self._given_up:  # given up on this rank once: never applied here
            pass
        elif action.action_id in self._applied_ids:  # dropped by the ranks while it was queued
            self._ignored["already_applied"] += 1
        else:
            self._count += 1
            self.pending[action.action_id] = (self._count, action)
        return True

    def pull_all(self) -> None:
        while self.pull():
            pass

    def next_nowait(self) -> Action | None:
        """The oldest pending action, taken; None when nothing has arrived."""
        while not self.pending:
            if not self.pull():
                return None
        return self.take(next(iter(self.pending)))

    def take(self, action_id: str) -> Action | None:
        """Take ``action_id`` out of ``pending`` to apply it, noting its arrival number (for a pause)."""
        entry = self.pending.pop(action_id, None)
        if entry is None:
            return None
        self._taken[action_id] = entry[0]
        return entry[1]

    def done(self, action_id: str) -> None:
        """``action_id`` was applied (or failed): forget its arrival number."""
        self._taken.pop(action_id, None)

    def discard(self, action_id: str) -> bool:
        """Forget ``action_id`` (applied by some rank before a restart); whether it was pending."""
        self._taken.pop(action_id, None)
        return self.pending.pop(action_id, None) is not None

    def give_up(self, action_id: str) -> None:
        """This rank stopped waiting for ``action_id``: a copy arriving later is dropped."""
        self._given_up.add(action_id)

    def arrival_of(self, action_id: str) -> int:
        """The arrival number of ``action_id`` if taken, else the newest arrival's."""
        return self._taken.get(action_id, self._count)

    def pause_ender(self, after: int) -> Action | None:
        """The first pending resume or stop that arrived after arrival number ``after`` with no
        other pause before it (a later pause is ended by what follows it)."""
        for seq, pending in self.pending.values():
            if seq <= after:
                continue
            if applies(pending.kind) == "pause":
                return None
            if pending.kind in PAUSE_ENDERS:
                return pending
        return None
