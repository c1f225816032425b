"""Goodput (issue 39): where a run's wall time went, computed in ClickHouse from its stored telemetry and
findings, and written to the ``goodput`` table (one row per run). docs/goodput.md defines it; in short:

* wall time: the run's first event to its last, every attempt together;
* each attempt's time is cut at rank 0's step events (``ts``: when the step ended): the stretch before a
  step is that step's own time (``step_time_s``, which leaves out eval, checkpoint and idle phases) and
  the off-step time before it (the rest of the stretch);
* a step's own time is **rollback-lost** when a rollback applied later went back to before it; else it
  is its **data wait** (``data_wait_s``), its **stall** (the part beyond the run's median step compute,
  in a step that a ``stall`` or ``hung_rank`` finding was raised in, or that took longer than
  ``STALL_FACTOR`` x the median + ``STALL_ALLOWANCE_S``: the stall detector's defaults) and the rest
  **productive**;
* off-step time is **checkpoint** and **eval** (the producer's ``off_step_s``), **startup** (before the
  first step of an attempt) and **other** (the rest: the lap between steps, idle phases, the time after
  the last step);
* **restart gap**: between one attempt's last event and the next attempt's start.

So the categories partition the wall time: their sum is the wall time up to rounding. The queries do the
per-step work in ClickHouse (one row per attempt comes back); the few sums per attempt are added here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runwatch.sinks.clickhouse import ClickHouseSink

STALL_FACTOR = 3.0  # a step longer than this many median step computes ...
STALL_ALLOWANCE_S = 10.0  # ... plus this many seconds is a stall even with no finding (StallConfig's train)
STALL_DETECTORS = ("stall", "hung_rank")

# The lost categories, in the order the report and the panel stack them (``productive`` first, then these).
LOST = ("rollback_lost", "stall", "checkpoint", "data_wait", "restart_gap", "startup", "eval", "other")
CATEGORIES = ("productive", *LOST)
GOODPUT_COLUMNS = (
    "run_id",
    "attempts",
    "steps",
    "steps_lost",
    "started_at",
    "ended_at",
    "wall_s",
    *(f"{name}_s" for name in CATEGORIES),
    "goodput",
)


@dataclass(frozen=True)
class Goodput:
    """One run's wall time and where it went, in seconds; ``goodput`` = productive / wall (0..1)."""

    run_id: str
    attempts: int
    steps: int  # rank 0's step events
    steps_lost: int  # of them, undone by a later rollback
    started_at: datetime
    ended_at: datetime
    wall_s: float
    productive_s: float = 0.0
    rollback_lost_s: float = 0.0
    stall_s: float = 0.0
    checkpoint_s: float = 0.0
    data_wait_s: float = 0.0
    restart_gap_s: float = 0.0
    startup_s: float = 0.0
    eval_s: float = 0.0
    other_s: float = 0.0

    @property
    def goodput(self) -> float | None:
        return self.productive_s / self.wall_s if self.wall_s > 0 else None

    def seconds(self) -> dict[str, float]:
        """Each category's seconds, productive first."""
        return {name: float(getattr(self, f"{name}_s")) for name in CATEGORIES}

    def accounted_s(self) -> float:
        """The categories' sum (the wall time, up to rounding)."""
        return sum(self.seconds().values())

    def row(self) -> tuple[Any, ...]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["goodput"] = self.goodput
        return tuple(values[c] for c in GOODPUT_COLUMNS)


# Every event's attempt: how many of rank 0's run_start events came at or before it (events before the
# first run_start are the first attempt's).
_ATTEMPT = "greatest(1, arrayCount(s -> s <= toFloat64(ts), starts))"
_STARTS = (
    "(SELECT arraySort(groupArray(toFloat64(ts))) FROM {db}.telemetry FINAL "
    "WHERE run_id = %(run)s AND kind = 'run_start' AND rank = 0) AS starts"
)

_ATTEMPTS_SQL = f"""
WITH {_STARTS}
SELECT {_ATTEMPT} AS attempt, toFloat64(min(ts)) AS first, toFloat64(max(ts)) AS last
FROM {{db}}.telemetry FINAL
WHERE run_id = %(run)s
GROUP BY attempt
ORDER BY attempt
"""

# Per attempt: rank 0's steps, each with the stretch before it, classified, then summed.
_STEPS_SQL = f"""
WITH
    {_STARTS},
    (SELECT groupArray((toFloat64(ts), JSONExtractInt(payload, 'to_step'))) FROM {{db}}.telemetry FINAL
     WHERE run_id = %(run)s AND kind = 'action_ack' AND rank = 0
       AND JSONExtractString(payload, 'action_kind') = 'rollback'
       AND JSONExtractString(payload, 'outcome') = 'applied') AS rollbacks,
    (SELECT groupArray(toFloat64(ts)) FROM {{db}}.anomalies FINAL
     WHERE run_id = %(run)s AND detector IN %(stall_detectors)s) AS stall_times,
    steps AS (
        SELECT
            {_ATTEMPT} AS attempt,
            toFloat64(ts) AS t,
            step,
            greatest(ifNull(step_time_s, 0.0), 0.0) AS own_raw,
            greatest(JSONExtractFloat(payload, 'data_wait_s'), 0.0) AS wait_raw,
            greatest(JSONExtractFloat(payload, 'off_step_s', 'checkpoint'), 0.0) AS ckpt_raw,
            greatest(JSONExtractFloat(payload, 'off_step_s', 'eval'), 0.0) AS eval_raw,
            arrayExists(r -> r.1 > t AND r.2 < step, rollbacks) AS lost,
            row_number() OVER (PARTITION BY attempt ORDER BY t, event_id) AS n,
            max(t) OVER (PARTITION BY attempt ORDER BY t, event_id ROWS BETWEEN 1 PRECEDING AND 1 PRECEDING)
                AS prev_t
        FROM {{db}}.telemetry FINAL
        WHERE run_id = %(run)s AND kind = 'step' AND rank = 0
    ),
    firsts AS (SELECT attempt, min(t0) AS first FROM (
        SELECT {_ATTEMPT} AS attempt, toFloat64(ts) AS t0 FROM {{db}}.telemetry FINAL WHERE run_id = %(run)s
    ) GROUP BY attempt),
    stretched AS (
        SELECT
            s.*,
            t - if(n = 1, f.first, prev_t) AS stretch,
            least(own_raw, stretch) AS own,
            least(wait_raw, own) AS wait,
            stretch - own AS off,
            least(ckpt_raw, off) AS ckpt,
            least(eval_raw, off - ckpt) AS ev,
            (if(n = 1, f.first, prev_t)) AS began
        FROM steps AS s INNER JOIN firsts AS f ON s.attempt = f.attempt
    ),
    (SELECT quantileExact(0.5)(own - wait) FROM stretched WHERE NOT lost AND own > 0) AS median_compute,
    classified AS (
        SELECT
            *,
            own - wait AS compute,
            NOT lost AND compute > median_compute AND (
                arrayExists(a -> a > began AND a <= t, stall_times)
                OR compute > %(stall_factor)s * median_compute + %(stall_allowance)s
            ) AS stalled,
            if(stalled, compute - median_compute, 0.0) AS stall
        FROM stretched
    )
SELECT *, arrayExists(a -> a > g_last_step, stall_times) AS g_stalled_after FROM (
SELECT
    attempt,
    count() AS g_steps,
    countIf(lost) AS g_steps_lost,
    max(t) AS g_last_step,
    sumIf(own, lost) AS g_rollback_lost,
    sumIf(wait, NOT lost) AS g_data_wait,
    sum(stall) AS g_stall,
    sumIf(compute - stall, NOT lost) AS g_productive,
    sum(ckpt) AS g_checkpoint,
    sum(ev) AS g_eval,
    sumIf(off - ckpt - ev, n = 1) AS g_startup,
    sumIf(off - ckpt - ev, n > 1) AS g_other
FROM classified
GROUP BY attempt
)
ORDER BY attempt
"""


def compute_goodput(sink: ClickHouseSink, run_id: str) -> Goodput | None:
    """``run_id``'s goodput from what ClickHouse holds of it; None when it holds no telemetry of it."""
    params: dict[str, Any] = {
        "run": run_id,
        "stall_detectors": STALL_DETECTORS,
        "stall_factor": STALL_FACTOR,
        "stall_allowance": STALL_ALLOWANCE_S,
    }
    attempts = sink.query(_ATTEMPTS_SQL, {"run": run_id})
    if not attempts:
        return None
    steps = {int(row[0]): row for row in sink.query(_STEPS_SQL, params)}
    return combine(run_id, attempts, steps)


def combine(run_id: str, attempts: Sequence[Sequence[Any]], steps: Mapping[int, Sequence[Any]]) -> Goodput:
    """The run's goodput from the queries' rows: ``attempts`` (attempt, first, last), ``steps`` by attempt
    (as ``_STEPS_SQL`` selects them). Pure."""
    total = {name: 0.0 for name in CATEGORIES}
    n_steps = n_lost = 0
    previous_last: float | None = None
    for attempt, first, last in attempts:
        first, last = float(first), float(last)
        if previous_last is not None:
            total["restart_gap"] += max(0.0, first - previous_last)
        previous_last = last
        row = steps.get(int(attempt))
        if row is None:  # an attempt that never stepped: all of it before a first step
            total["startup"] += last - first
            continue
        (
            _,
            count,
            lost,
            last_step,
            rollback,
            wait,
            stall,
            productive,
            ckpt,
            ev,
            startup,
            other,
            stalled_after,
        ) = row
        n_steps += int(count)
        n_lost += int(lost)
        total["rollback_lost"] += float(rollback)
        total["data_wait"] += float(wait)
        total["stall"] += float(stall)
        total["productive"] += float(productive)
        total["checkpoint"] += float(ckpt)
        total["eval"] += float(ev)
        total["startup"] += float(startup)
        total["other"] += float(other)
        tail = max(0.0, last - float(last_step))  # after the last step: a hang that ended it, or the shutdown
        total["stall" if stalled_after else "other"] += tail
    first_ts, last_ts = float(attempts[0][1]), float(attempts[-1][2])
    return Goodput(
        run_id=run_id,
        attempts=len(attempts),
        steps=n_steps,
        steps_lost=n_lost,
        started_at=datetime.fromtimestamp(first_ts, UTC),
        ended_at=datetime.fromtimestamp(last_ts, UTC),
        wall_s=last_ts - first_ts,
        **{f"{name}_s": value for name, value in total.items()},
    )


def write_goodput(sink: ClickHouseSink, goodput: Goodput) -> None:
    """Store (or replace: the table keeps the newest row per run) one run's goodput."""
    sink.insert("goodput", [(*goodput.row(), datetime.now(UTC))], (*GOODPUT_COLUMNS, "computed_at"))


def stored_goodput(sink: ClickHouseSink, run_id: str) -> Goodput | None:
    """The stored row of ``run_id``, or None."""
    columns = ", ".join(c for c in GOODPUT_COLUMNS if c != "goodput")
    rows = sink.query(f"SELECT {columns} FROM {{db}}.goodput FINAL WHERE run_id = %(run)s", {"run": run_id})
    if not rows:
        return None
    names = [c for c in GOODPUT_COLUMNS if c != "goodput"]
    values = dict(zip(names, rows[0], strict=True))
    for name in ("started_at", "ended_at"):
        ts = values[name]
        values[name] = ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)
    return Goodput(**values)
