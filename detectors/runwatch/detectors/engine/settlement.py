"""``RollbackSettlement``: an applied rollback, from its first acknowledgement until every rank's.

The first rank that acknowledges a rollback as applied has the monitor rewind its step-indexed detectors
to the rollback's checkpoint (rewind.py). The rollback is settled once every rank has acknowledged it.
Until then a rank that has not is still sending steps from before it (ranks publish independently, so one
rank's acknowledgement can arrive before another's last faulty steps): those steps, and the joined steps
up to the first acknowledging rank's newest, are kept out of the rewound detectors, and the policy holds
further rollbacks. The settlement holds no clock: one never settled expires with the policy's rollback
(``expire``). Its state pickles with the monitor's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runwatch.detectors.engine.rank_join import Key, StepJoin


@dataclass
class RollbackSettlement:
    rewound_for: str | None = None  # the rollback whose ack rewound the detectors (one per rollback)
    settling: str | None = None  # the applied rollback not every rank has acknowledged yet
    waiting: set[int] = field(default_factory=set)  # ranks yet to acknowledge it
    stale_through: Key | None = None  # joined steps up to this (generation, step) came before it

    def applied(self, action_id: str, rank: int, join: StepJoin) -> bool:
        """``rank`` applied rollback ``action_id``: whether it is the first to (every rank acks: the
        detectors are rewound once, at the first), which starts the settlement."""
        if self.rewound_for == action_id:
            return False
        self.rewound_for = self.settling = action_id
        self.waiting = join.expected()
        # Every step up to the acknowledging rank's newest came before the rollback; what follows is the
        # replay (a step counter that goes back starts a new generation, one that does not goes on past it).
        self.stale_through = join.last_key(rank)
        return True

    def acknowledged(self, action_id: str, rank: int) -> bool:
        """``rank`` acknowledged ``action_id`` (applied or not): whether the policy may now take the action
        as acknowledged (it is no rollback being settled, or ``rank`` was the last it waited for)."""
        if self.settling != action_id:
            return True  # not applied anywhere: nothing is in flight
        waiting = self.waiting
        waiting.discard(rank)  # (in place: a copy per ack is the world squared at 16,384 ranks)
        if waiting:
            return False
        self.settling = None
        return True

    def waits_for(self, rank: int) -> bool:
        """Whether a rollback is settling that ``rank`` has not acknowledged (its steps came before it)."""
        return self.settling is not None and rank in self.waiting

    def expire(self) -> None:
        """The rollback was never acknowledged by every rank, and expired: nothing is held back any more."""
        self.settling, self.waiting = None, set()
