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

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

from runwatch.producer.wire.schema import RANKS_LISTED, CategoryLoss, JoinedStep, StepEvent

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


class StepJoin:
    """Joins one run's step events across ranks (see the module doc). Pure; pickles."""

    def __init__(self, run_id: str, timeout_s: float = 10.0):
        self.run_id = run_id
        self.timeout = timedelta(seconds=timeout_s)
        self.world_size = 1  # raised by run_start and by any higher rank seen
        self.absent: set[int] = set()  # ranks left out of a timed-out join and silent since
        self._last_key: dict[int, Key] = {}  # rank -> its newest (generation, step)
        self._pending: dict[Key, _Pending] = {}
        self._emitted: Key | None = None  # the newest key emitted
        self.late = 0
        self.duplicates = 0
        self.joined = 0

    def set_world_size(self, world_size: int) -> None:
        self.world_size = max(self.world_size, world_size)

    def count_duplicate(self) -> None:
        """An event of the run delivered again, dropped before it reached the join (the joined steps
        report how many)."""
        self.duplicates += 1

    def expected(self) -> set[int]:
        return set(range(self.world_size)) - self.absent

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
        return len(pending.events) - absent_reported >= self.world_size - len(self.absent)

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
            missing = sorted(set(range(self.world_size)) - pending.events.keys())
            out.append(self._combine(key, pending, missing))
            self._emitted = key
        self.joined += len(out)
        return out

    def _combine(self, key: Key, pending: _Pending, missing: list[int]) -> Joined:
        if self.world_size == 1 and len(pending.events) == 1:
            # nothing to combine
            return Joined(event=next(iter(pending.events.values())), record=None, generation=key[0])
        events = [pending.events[r] for r in sorted(pending.events)]
        fields = self._combined_fields(key, events)
        _add_update_ratios(fields)
        memory_rank = _argmax(events, _memory_figure)
        if memory_rank is not None:
            fields["memory"] = pending.events[memory_rank].memory
        event = StepEvent.model_construct(**fields)  # built from validated parts: no second validation
        record = self._record(key, pending, missing, events, fields, memory_rank)
        return Joined(event=event, record=record, generation=key[0])

    def _combined_fields(self, key: Key, events: list[StepEvent]) -> dict[str, Any]:
        """The joined step event's fields, each combined across the ranks' ``events`` (see the module doc)."""
        sharded = all(e.grad_sharded for e in events)
        norm = _root_sum_squares if sharded else _largest
        return {
            "run_id": self.run_id,
            "rank": events[0].rank,
            "step": key[1],
            "ts": max(e.ts for e in events),
            "event_id": f"joined|{key[0]}|{key[1]}",
            "lr": events[0].lr,
            "loss": _mean(e.loss for e in events),
            "grad_norm": norm(e.grad_norm for e in events),
            "grad_norm_clipped": norm(e.grad_norm_clipped for e in events),
            "clip_ratio": _smallest(e.clip_ratio for e in events),
            "param_norm": norm(e.param_norm for e in events),
            "update_norm": norm(e.update_norm for e in events),
            "module_grad_norms": _merge_modules([e.module_grad_norms for e in events], norm),
            "category_loss": _merge_categories([e.category_loss for e in events]),
            "step_time_s": _largest(e.step_time_s for e in events),
            "data_wait_s": _largest(e.data_wait_s for e in events),
            "samples_per_s": _sum(e.samples_per_s for e in events),
            "tokens_per_s": _sum(e.tokens_per_s for e in events),
            "mfu": _mean(e.mfu for e in events),
            "nonfinite_grads": _sum_int(e.nonfinite_grads for e in events),
            "grad_sharded": sharded or None,
        }

    def _record(
        self,
        key: Key,
        pending: _Pending,
        missing: list[int],
        events: list[StepEvent],
        fields: dict[str, Any],
        memory_rank: int | None,
    ) -> JoinedStep:
        """The join's record of the step: who reported, and the extremes across ranks with their rank.
        ``fields``: the joined event's (:meth:`_combined_fields`); ``memory_rank``: the rank using the most
        memory."""
        memory_min_rank = _argmin(events, _memory_figure)
        return JoinedStep(
            run_id=self.run_id,
            step=key[1],
            generation=key[0],
            ts=fields["ts"],
            world_size=self.world_size,
            complete=not missing,
            # (by id only while few: RANKS_LISTED)
            ranks_reported=sorted(pending.events) if self.world_size <= RANKS_LISTED else [],
            ranks_missing=missing[:RANKS_LISTED],
            reported_count=len(pending.events),
            missing_count=len(missing),
            loss_mean=fields["loss"],
            grad_norm=fields["grad_norm"],
            grad_sharded=bool(fields["grad_sharded"]),
            step_time_max_s=fields["step_time_s"],
            step_time_max_rank=_argmax(events, lambda e: e.step_time_s),
            step_time_min_s=_smallest(e.step_time_s for e in events),
            compute_max_s=_largest(e.compute_s for e in events),
            compute_max_rank=_argmax(events, lambda e: e.compute_s),
            compute_min_s=_smallest(e.compute_s for e in events),
            memory_max_bytes=_memory_figure(pending.events[memory_rank]) if memory_rank is not None else None,
            memory_max_rank=memory_rank,
            memory_min_bytes=_memory_figure(pending.events[memory_min_rank])
            if memory_min_rank is not None
            else None,
            memory_min_rank=memory_min_rank,
            samples_per_s=fields["samples_per_s"],
            tokens_per_s=fields["tokens_per_s"],
            late_events=self.late,
            duplicate_events=self.duplicates,
        )


def _add_update_ratios(fields: dict[str, Any]) -> None:
    """The joined step's update ratios, from its combined norms: the update relative to the parameters,
    and the effective learning rate (the update relative to the applied gradient)."""
    if fields["param_norm"] and fields["update_norm"] is not None:
        fields["relative_update_norm"] = fields["update_norm"] / fields["param_norm"]
    clipped = fields["grad_norm_clipped"] if fields["grad_norm_clipped"] is not None else fields["grad_norm"]
    if fields["update_norm"] is not None and clipped and math.isfinite(clipped):
        fields["effective_lr_ratio"] = fields["update_norm"] / clipped


def _memory_figure(event: StepEvent) -> int | None:
    """Device memory where there is a device, else the host process's."""
    m = event.memory
    if m is None:
        return None
    return m.allocated if m.allocated is not None else m.host_rss


_Number = TypeVar("_Number", int, float)
_Norm = Callable[[Iterable[float | None]], float | None]


def _present(values: Iterable[_Number | None]) -> list[_Number]:
    return [v for v in values if v is not None]


def _mean(values: Iterable[float | None]) -> float | None:
    got = _present(values)
    return sum(got) / len(got) if got else None  # a NaN on one rank makes the mean NaN, as it should


def _sum(values: Iterable[float | None]) -> float | None:
    got = _present(values)
    return float(sum(got)) if got else None


def _sum_int(values: Iterable[int | None]) -> int | None:
    got = _present(values)
    return int(sum(got)) if got else None


def _largest(values: Iterable[float | None]) -> float | None:
    got = _present(values)
    if not got:
        return None
    return math.nan if any(math.isnan(v) for v in got) else max(got)  # max() would skip a NaN


def _smallest(values: Iterable[float | None]) -> float | None:
    got = _present(values)
    if not got:
        return None
    return math.nan if any(math.isnan(v) for v in got) else min(got)


def _root_sum_squares(values: Iterable[float | None]) -> float | None:
    got = _present(values)
    return math.sqrt(sum(v * v for v in got)) if got else None


def _argmax(events: list[StepEvent], figure: Callable[[StepEvent], float | None]) -> int | None:
    best: tuple[float, int] | None = None
    for e in events:
        value = figure(e)
        if value is not None and (best is None or value > best[0]):
            best = (value, e.rank)
    return None if best is None else best[1]


def _argmin(events: list[StepEvent], figure: Callable[[StepEvent], float | None]) -> int | None:
    best: tuple[float, int] | None = None
    for e in events:
        value = figure(e)
        if value is not None and (best is None or value < best[0]):
            best = (value, e.rank)
    return None if best is None else best[1]


def _merge_modules(per_rank: list[dict[str, float]], norm: _Norm) -> Mapping[str, float | None]:
    if len(per_rank) == 1:
        return per_rank[0]
    names: dict[str, list[float]] = {}
    for modules in per_rank:
        for name, value in modules.items():
            names.setdefault(name, []).append(value)
    return {name: norm(values) for name, values in names.items()}


def _merge_categories(per_rank: list[dict[str, CategoryLoss]]) -> dict[str, CategoryLoss]:
    if len(per_rank) == 1:
        return per_rank[0]
    totals: dict[str, list[float]] = {}
    for categories in per_rank:
        for name, c in categories.items():
            if c.count > 0:
                acc = totals.setdefault(name, [0.0, 0])
                acc[0] += c.mean * c.count
                acc[1] += c.count
    return {name: CategoryLoss.model_construct(mean=s / n, count=int(n)) for name, (s, n) in totals.items()}
