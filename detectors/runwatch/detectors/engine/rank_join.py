"""The per-step join across the ranks of one run: many ranks' step events in, one joined step out.

A step is joined when every rank expected to report has reported it, or ``timeout_s`` of event
time after its first report (then ``complete`` is False and the missing ranks are named; a rank
missing from a timed-out step is not waited for again until it reports, so a dead rank costs one
timeout, not one per step).

Ordering. Each rank's events arrive in the order the rank sent them (one partition per run; the
producer keeps order, its spool too), but ranks interleave freely. So when a step is complete,
every earlier step has received all it ever will (each rank sent those first), and they are
emitted too, as partial if need be. Joined steps therefore come out in step order, each once.

Rollbacks. A rank whose step goes back (a rollback, a resume) starts a new *generation*; steps
are joined by (generation, step), so a step replayed after a rollback is joined afresh rather than
taken for a late copy. Duplicates (the same rank and key again) are dropped; events whose step was
already emitted are counted as late and left out of the join (the per-rank views still see them).

Combining: gradient figures (``grad_norm``, ``grad_norm_clipped``, per-module norms, ``param_norm``,
``update_norm``) are the root of the sum of squares when the ranks report shards
(``grad_sharded``), else the largest (replicas agree, so any; the largest is conservative); loss
is the mean; step time, compute time and memory are the extremes with their rank; samples/s and
tokens/s are summed (the run's throughput); per-category losses are merged weighted by count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from runwatch.contract.group_report import StepPartial
from runwatch.contract.schema import JoinedStep, StepEvent
from runwatch.detectors.engine.step_partial import joined_fields, joined_record, partial_of

Key = tuple[int, int]  # (generation, step)


@dataclass
class _Pending:
    first_ts: datetime
    events: dict[int, StepEvent] = field(default_factory=dict)  # rank -> its event


class Joined(NamedTuple):
    """A joined step: ``event`` (a ``StepEvent`` the run-level detectors read) and its ``record``
    (None for a single-rank run, whose joined step is its one rank's event). A named tuple, not a frozen
    dataclass: one is made per step on the worker's hot path, and a frozen dataclass costs three times
    as much to make (it is never pickled: only handed from the join to the monitor)."""

    event: StepEvent
    record: JoinedStep | None
    generation: int = 0  # of its key: a step sent before a rollback took effect is of an older one
    partial: StepPartial | None = None  # what it was made of (None: a single rank's step)


class StepJoin:
    """Joins one run's step events across ranks (see the module doc). Pure; pickles."""

    first_rank = 0  # (a class default too: a join pickled before groups existed reads 0)

    def __init__(self, run_id: str, timeout_s: float = 10.0):
        self.run_id = run_id
        self.timeout = timedelta(seconds=timeout_s)
        self.world_size = 1  # raised by run_start and by any higher rank seen
        # The first rank joined: 0, or a rank group's first (a split run's stage one joins ranks
        # first_rank .. world_size - 1 of its group: set_ranks)
        self.first_rank = 0
        self.absent: set[int] = set()  # ranks left out of a timed-out join and silent since
        self._last_key: dict[int, Key] = {}  # rank -> its newest (generation, step)
        self._pending: dict[Key, _Pending] = {}
        self._emitted: Key | None = None  # the newest key emitted
        self.late = 0
        self.duplicates = 0
        self.joined = 0

    def set_world_size(self, world_size: int) -> None:
        self.world_size = max(self.world_size, world_size)

    def set_ranks(self, ranks: range) -> None:
        """Join only ``ranks`` (a rank group's: stage one of a split run)."""
        self.first_rank, self.world_size = ranks.start, max(ranks.stop, ranks.start + 1)

    def count_duplicate(self) -> None:
        """An event of the run delivered again, dropped before it reached the join (the joined steps
        report how many)."""
        self.duplicates += 1

    def expected(self) -> set[int]:
        return set(range(self.first_rank, self.world_size)) - self.absent

    def add(self, event: StepEvent) -> list[Joined]:
        """Take one rank's step event; returns the steps it completes (in step order)."""
        rank = event.rank
        key = self._advance(rank, event.step)
        # A single-rank run (the common case, on the worker's hot path) has nothing to wait for.
        single = rank == 0 and self.world_size == 1 and not self._pending and not self.absent
        if not single:
            self.set_world_size(rank + 1)
            self.absent.discard(rank)
        if self._emitted is not None and key <= self._emitted:
            self.late += 1
            return [] if single else self.expire(event.ts)
        if single:
            self._emitted = key
            self.joined += 1
            return [Joined(event=event, record=None, generation=key[0])]
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(first_ts=event.ts)
        if rank in pending.events:
            self.duplicates += 1
            return self.expire(event.ts)
        pending.events[rank] = event
        if self._complete(pending):
            return self._emit_through(key, event.ts)
        return self.expire(event.ts)

    def _complete(self, pending: _Pending) -> bool:
        """Whether every expected rank has reported ``pending`` (``expected() <= its ranks``), counted
        in the size of ``absent`` rather than the world's: this runs for every event, and building the
        expected set made a step of 4,096 ranks cost 4,096 x 4,096 (issue 36)."""
        absent_reported = sum(1 for r in self.absent if r in pending.events) if self.absent else 0
        return len(pending.events) - absent_reported >= self.world_size - self.first_rank - len(self.absent)

    def _advance(self, rank: int, step: int) -> Key:
        """The (generation, step) key of a rank's new step: a step going back (a rollback, a resume)
        starts the rank's next generation."""
        last = self._last_key.get(rank)
        generation = 0 if last is None else last[0] + (step < last[1])
        key = self._last_key[rank] = (generation, step)
        return key

    def last_key(self, rank: int) -> Key | None:
        """The (generation, step) of ``rank``'s newest step, or None before any."""
        return self._last_key.get(rank)

    def expire(self, now: datetime) -> list[Joined]:
        """Emit the steps that have waited ``timeout_s`` (and every earlier one), as partial."""
        due = [key for key, p in self._pending.items() if now - p.first_ts >= self.timeout]
        if not due:
            return []
        return self._emit_through(max(due), now)

    def flush(self) -> list[Joined]:
        """Emit every step still waiting, as partial (the run is over)."""
        if not self._pending:
            return []
        last = max(self._pending)
        return self._emit_through(last, self._pending[last].first_ts)

    def _emit_through(self, last: Key, now: datetime) -> list[Joined]:
        out = []
        for key in sorted(k for k in self._pending if k <= last):
            pending = self._pending.pop(key)
            # A rank that has not reported this step, nor any later one, is not waited for until heard.
            self.absent.update(
                r for r in self.expected() - pending.events.keys() if self._last_key.get(r, (-1, -1)) < key
            )
            missing = sorted(set(range(self.first_rank, self.world_size)) - pending.events.keys())
            out.append(self._combine(key, pending, missing))
            self._emitted = key
        self.joined += len(out)
        return out

    def _combine(self, key: Key, pending: _Pending, missing: list[int]) -> Joined:
        if self.world_size == 1 and len(pending.events) == 1:
            # nothing to combine
            return Joined(event=next(iter(pending.events.values())), record=None, generation=key[0])
        events = [pending.events[r] for r in sorted(pending.events)]
        partial = partial_of(key, events, self.world_size - self.first_rank, missing)
        return joined_from(self.run_id, partial, self.world_size, self.late, self.duplicates)


def joined_from(run_id: str, partial: StepPartial, world_size: int, late: int, duplicates: int) -> Joined:
    """The joined step of a run's partial of it (the partial rides along, for a group's report)."""
    fields = joined_fields(run_id, partial)
    event = StepEvent.model_construct(**fields)  # built from validated parts: no second validation
    record = joined_record(run_id, partial, world_size, fields, late, duplicates)
    return Joined(event=event, record=record, generation=partial.generation, partial=partial)
