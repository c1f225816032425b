"""The per-run budget of a telemetry partition (worker/runwatch/worker/run_budget.py): a live
flood of one run, or of made-up run ids, is shed; other runs, a backlog and a run within its budget are
not, however their records are fetched."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from runwatch.worker.run_budget import MAX_SHED_REPORTS, BudgetLimits, RunBudget

LIMITS = BudgetLimits(events_per_s=2_000, burst_events=4_000, new_runs_per_s=50, new_runs_burst=500)


@dataclass(frozen=True)
class Rec:
    offset: int
    key: bytes | None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fetch(budget: RunBudget, clock: Clock, at: float, end: int, records: list[Rec]):
    """One fetch as the consumer makes it: the log's end noted at ``at``, then the records judged."""
    clock.now = at
    budget.note_end(0, end)
    return budget.split(0, records)


def test_a_live_flood_of_one_run_is_shed_and_the_victim_behind_it_is_not():
    clock = Clock()
    budget = RunBudget(LIMITS, clock)
    victim = [Rec(0, b"victim"), Rec(1, b"victim")]
    kept, shed = fetch(budget, clock, 100.0, 0, [])  # (the partition is watched from here)
    assert (kept, shed) == ([], [])
    kept, _ = fetch(budget, clock, 100.5, 2, victim)
    assert kept == victim
    # 200,000 events of one run reach the log within a second, then the victim's NaN step
    flood = [Rec(2 + i, b"flood") for i in range(200_000)]
    behind = Rec(200_002, b"victim")
    clock.now = 101.5
    budget.note_end(0, 200_002)
    clock.now = 101.6
    budget.note_end(0, 200_003)
    kept_total, shed_ranges = [], []
    for start in range(0, len(flood), 10_000):  # read in fetches of 10,000, as aiokafka hands them
        kept, shed = budget.split(0, flood[start : start + 10_000])
        kept_total += kept
        shed_ranges += shed
    # what follows the last event handed on was shed: the worker's tick does not wait for it
    assert budget.read_through(0) == 200_001 and budget.caught_up(0, submitted=kept_total[-1].offset)
    kept, shed = budget.split(0, [behind])
    assert kept == [behind]
    assert not budget.caught_up(0, submitted=kept_total[-1].offset)
    # the burst and one second's budget go on; the rest is shed, in ranges that cover every shed offset
    assert 4_000 <= len(kept_total) <= 4_000 + 2_000 + 10
    assert sum(last - first + 1 for first, last in shed_ranges) == len(flood) - len(kept_total)
    assert budget.shed_total == len(flood) - len(kept_total)
    report = budget.take_shed()
    assert list(report.runs) == [(0, b"flood")]
    assert report.runs[(0, b"flood")].count == budget.shed_total
    assert report.runs[(0, b"flood")].reason == "over_budget"
    assert budget.take_shed().events == 0  # (counted once)


def test_a_backlog_read_after_a_restart_is_never_shed():
    clock = Clock()
    budget = RunBudget(LIMITS, clock)
    backlog = [Rec(i, b"run") for i in range(100_000)]
    kept, shed = fetch(budget, clock, 100.0, len(backlog), backlog[:50_000])
    assert shed == [] and len(kept) == 50_000
    kept, shed = fetch(budget, clock, 100.1, len(backlog), backlog[50_000:])
    assert shed == [] and len(kept) == 50_000


def test_a_run_within_its_budget_keeps_every_event_when_a_pause_bunches_its_fetches():
    clock = Clock()
    budget = RunBudget(LIMITS, clock)
    fetch(budget, clock, 100.0, 0, [])
    # 1,500 events/s for 10 s, fetched in one go after the partition was paused (buffer full)
    records = [Rec(i, b"run") for i in range(15_000)]
    kept, shed = fetch(budget, clock, 110.0, 15_000, records)
    assert shed == [] and len(kept) == 15_000


def test_a_flood_of_made_up_run_ids_is_shed_and_known_runs_go_on():
    clock = Clock()
    budget = RunBudget(LIMITS, clock)
    fetch(budget, clock, 100.0, 0, [])
    fetch(budget, clock, 100.5, 1, [Rec(0, b"known")])
    records = [Rec(1 + i, f"fake-{i}".encode()) for i in range(10_000)] + [Rec(10_001, b"known")]
    kept, shed = fetch(budget, clock, 101.0, 10_002, records)
    assert kept[-1] == Rec(10_001, b"known")
    assert 500 <= len(kept) - 1 <= 500 + 50
    assert budget.shed_new_runs == 10_000 - (len(kept) - 1)
    report = budget.take_shed()
    assert len(report.runs) == MAX_SHED_REPORTS  # one by one, then summed
    assert report.events == budget.shed_new_runs
    assert {s.reason for s in report.runs.values()} == {"new_run"}


def test_without_a_note_of_the_log_end_or_with_no_budget_everything_goes_on():
    clock = Clock()
    records = [Rec(i, b"run") for i in range(20_000)]
    assert RunBudget(LIMITS, clock).split(0, records) == (records, [])
    off = RunBudget(BudgetLimits(0, 1, 1, 1), clock)
    off.note_end(0, 0)
    off.note_end(0, 20_000)
    assert off.split(0, records) == (records, [])


@pytest.mark.parametrize("forget", [{0}, None])
def test_a_partition_forgotten_at_a_seek_is_watched_anew(forget):
    clock = Clock()
    budget = RunBudget(LIMITS, clock)
    fetch(budget, clock, 100.0, 0, [])
    records = [Rec(i, b"run") for i in range(20_000)]
    kept, _ = fetch(budget, clock, 100.1, 20_000, records)
    assert len(kept) < 20_000
    budget.forget(forget)
    kept, shed = fetch(budget, clock, 100.2, 20_000, records)  # (read again after a seek: a backlog)
    assert shed == [] and kept == records
