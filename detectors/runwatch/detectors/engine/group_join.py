"""Stage two of a split run (issue 36): the run's joined steps from its rank groups' partials.

Each group's worker joins its ranks' step events (rank_join.StepJoin over the group's ranks) and reports
every joined step as a ``StepPartial``. Here the partials of one (generation, step) from every group are
merged (step_partial.merge) into the run's partial, and that into the joined step the run-level detectors
read, exactly as a run that is not split gets it. A step is joined when every expected group has reported
it, or ``timeout_s`` of event time after its first partial (its missing groups' ranks are then all
missing); a group missing from a timed-out step is not waited for again until it reports. Each group's
partials arrive in its order (one producer per group's worker, one partition per run key), so, as in
rank_join, a complete step means every earlier step has received all it will.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from runwatch.contract.group_report import StepPartial
from runwatch.contract.groups import group_ranks, groups_in
from runwatch.detectors.engine.rank_join import Joined, joined_from
from runwatch.detectors.engine.step_partial import merge

Key = tuple[int, int]  # (generation, step)


@dataclass
class _Pending:
    first_ts: datetime
    partials: dict[int, StepPartial] = field(default_factory=dict)  # group -> its partial


class GroupJoin:
    """Merges one split run's group partials into its joined steps. Pure; pickles."""

    def __init__(self, run_id: str, timeout_s: float = 10.0):
        self.run_id = run_id
        self.timeout = timedelta(seconds=timeout_s)
        self.world_size = 1
        self.group_size = 1
        self.absent: set[int] = set()  # groups left out of a timed-out step and silent since
        self._pending: dict[Key, _Pending] = {}
        self._emitted: Key | None = None
        self.late = 0  # partials of a step already joined
        self.group_late: dict[int, int] = {}  # the groups' own counts (their reports say them)
        self.group_duplicates: dict[int, int] = {}
        self.joined = 0

    def set_shape(self, world_size: int, group_size: int) -> None:
        self.world_size, self.group_size = world_size, group_size

    @property
    def groups(self) -> int:
        return groups_in(self.world_size, self.group_size)

    def counts(self, group: int, late: int, duplicates: int) -> None:
        """A group's own late and duplicate counts (from its report)."""
        self.group_late[group], self.group_duplicates[group] = late, duplicates

    def add(self, group: int, partial: StepPartial) -> list[Joined]:
        key = (partial.generation, partial.step)
        self.absent.discard(group)
        if self._emitted is not None and key <= self._emitted:
            self.late += 1
            return self.expire(partial.ts)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(first_ts=partial.ts)
        pending.partials[group] = partial  # (a report read again replaces its copy)
        reported_absent = sum(1 for g in self.absent if g in pending.partials)
        if len(pending.partials) - reported_absent >= self.groups - len(self.absent):
            return self._emit_through(key)
        return self.expire(partial.ts)

    def expire(self, now: datetime) -> list[Joined]:
        due = [key for key, p in self._pending.items() if now - p.first_ts >= self.timeout]
        return self._emit_through(max(due)) if due else []

    def flush(self) -> list[Joined]:
        return self._emit_through(max(self._pending)) if self._pending else []

    def _emit_through(self, last: Key) -> list[Joined]:
        out = []
        for key in sorted(k for k in self._pending if k <= last):
            pending = self._pending.pop(key)
            silent = set(range(self.groups)) - pending.partials.keys()
            self.absent.update(silent)
            partial = merge(
                list(pending.partials.values()),
                self.world_size,
                [group_ranks(g, self.group_size, self.world_size) for g in sorted(silent)],
            )
            late = self.late + sum(self.group_late.values())
            out.append(
                joined_from(self.run_id, partial, self.world_size, late, sum(self.group_duplicates.values()))
            )
            self._emitted = key
        self.joined += len(out)
        return out
