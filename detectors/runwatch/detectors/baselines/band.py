"""The per-step baseline band: where earlier runs of the same job were at each step.

For the in-flight comparison (``detectors/runwatch/detectors/baseline_trajectory.py``): per metric and per
step, the low / middle / high quantiles (default 10% / 50% / 90%) of the values the baseline runs had at that
step. The metrics are rank 0's per-step loss, grad norm, each module's grad norm
(``module_grad_norm/<module>``), step time, memory (``memory_allocated`` / ``memory_peak`` /
``memory_host_rss`` where reported), and the eval loss at each eval step (``eval_loss/<split>``).

Steps may be bucketed (``bucket_steps``: every step of a bucket, of every run, pools into the
bucket's quantiles), which bounds the band's size for long runs; a bucket is named by its first
step. Within one run a step seen twice (replayed after a rollback) counts once, with its newest
value. Quantiles interpolate linearly between order statistics (R-7, numpy's default; ClickHouse's
``quantileExactInclusive``), so ``band_from_runs`` here and ``BaselineReads.band`` give
the same band.

Which runs make the band (``select_baseline_runs``): the newest ``max_runs`` of the run's history
as the gate chooses it (``check.select_history``: the same baseline key and hardware fingerprint,
completed, started before the run and within the window, not before the latest declared new
baseline; a run declaring one has no history).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar

from pydantic import BaseModel, Field

from runwatch.contract.schema import EvalEvent, RunEndEvent, RunStartEvent, StepEvent, TelemetryEvent
from runwatch.detectors.baselines.check import select_history
from runwatch.detectors.baselines.compare import BaselineConfig
from runwatch.detectors.baselines.summary import NEW_BASELINE_TAG, fingerprint_id, hardware_fingerprint

DEFAULT_QUANTILES = (0.1, 0.5, 0.9)
MODULE_PREFIX = "module_grad_norm/"
EVAL_PREFIX = "eval_loss/"
# per-step metrics taken straight from a step event's fields / its memory's fields
STEP_FIELDS = ("loss", "grad_norm", "step_time_s")
MEMORY_FIELDS = {"memory_allocated": "allocated", "memory_peak": "peak", "memory_host_rss": "host_rss"}


class MetricBand(BaseModel):
    """One metric's band: parallel lists, one entry per step bucket (ascending)."""

    steps: list[int] = Field(description="each bucket's first step")
    lo: list[float]
    mid: list[float]
    hi: list[float]
    runs: list[int] = Field(description="how many baseline runs had a value in the bucket")


class BaselineBand(BaseModel):
    """Per metric, per step (bucket), the quantiles of the baseline runs' values. Never changed once
    built: the monitor's rewind snapshots refer to it instead of copying it (engine/rewind.py)."""

    shared_in_snapshots: ClassVar[bool] = True
    baseline_key: str
    fingerprint: str
    run_ids: list[str] = Field(description="the baseline runs, oldest first")
    quantiles: tuple[float, float, float] = DEFAULT_QUANTILES
    bucket_steps: int = Field(default=1, ge=1, description="steps per bucket")
    metrics: dict[str, MetricBand] = Field(default_factory=dict)

    @property
    def n_runs(self) -> int:
        return len(self.run_ids)


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolating linearly (R-7)."""
    at = (len(ordered) - 1) * q
    lo = math.floor(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def step_values(event: TelemetryEvent, *, any_rank: bool = False) -> Iterator[tuple[str, int, float]]:
    """(metric, step, value) of one step or eval event of rank 0 (of any rank: ``any_rank``), finite
    values only."""
    if event.rank != 0 and not any_rank:
        return
    if isinstance(event, StepEvent):
        for name in STEP_FIELDS:
            value = getattr(event, name)
            if value is not None and math.isfinite(value):
                yield name, event.step, float(value)
        if event.memory is not None:
            for name, attr in MEMORY_FIELDS.items():
                value = getattr(event.memory, attr)
                if value is not None:
                    yield name, event.step, float(value)
        for module, norm in event.module_grad_norms.items():
            if norm is not None and math.isfinite(norm):
                yield MODULE_PREFIX + module, event.step, float(norm)
    elif isinstance(event, EvalEvent):
        if event.loss is not None and math.isfinite(event.loss):
            yield EVAL_PREFIX + event.split, event.step, float(event.loss)


def band_from_runs(
    runs: Sequence[Sequence[TelemetryEvent]],
    *,
    baseline_key: str,
    fingerprint: str,
    quantiles: tuple[float, float, float] = DEFAULT_QUANTILES,
    bucket_steps: int = 1,
) -> BaselineBand:
    """The band of ``runs`` (each a run's events in order; rank 0's steps and evals are used)."""
    if bucket_steps < 1:
        raise ValueError("bucket_steps must be at least 1")
    pooled: dict[tuple[str, int], list[float]] = {}
    counted: dict[tuple[str, int], set[int]] = {}
    run_ids = []
    for index, events in enumerate(runs):
        if events:
            run_ids.append(events[0].run_id)
        newest: dict[tuple[str, int], float] = {}  # (metric, step) -> the newest value of this run
        for event in events:
            for metric, step, value in step_values(event):
                newest[(metric, step)] = value
        for (metric, step), value in newest.items():
            key = (metric, step // bucket_steps * bucket_steps)
            pooled.setdefault(key, []).append(value)
            counted.setdefault(key, set()).add(index)
    metrics: dict[str, MetricBand] = {}
    for metric, bucket in sorted(pooled):
        ordered = sorted(pooled[(metric, bucket)])
        band = metrics.get(metric)
        if band is None:
            band = metrics[metric] = MetricBand(steps=[], lo=[], mid=[], hi=[], runs=[])
        band.steps.append(bucket)
        band.lo.append(quantile(ordered, quantiles[0]))
        band.mid.append(quantile(ordered, quantiles[1]))
        band.hi.append(quantile(ordered, quantiles[2]))
        band.runs.append(len(counted[(metric, bucket)]))
    return BaselineBand(
        baseline_key=baseline_key,
        fingerprint=fingerprint,
        run_ids=run_ids,
        quantiles=quantiles,
        bucket_steps=bucket_steps,
        metrics=metrics,
    )


def bucket_steps_for(last_step: int, max_buckets: int) -> int:
    """Steps per bucket so that steps 0..``last_step`` make at most ``max_buckets`` buckets."""
    return max(1, math.ceil((last_step + 1) / max_buckets))


# -- which runs make the band ----------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    """What choosing a run's baseline needs to know of a run."""

    run_id: str
    baseline_key: str | None
    fingerprint: str
    started_at: datetime | None
    status: str  # the run_end's status, "running" without one
    new_baseline: bool = False


def run_fingerprint(start: RunStartEvent | None) -> str:
    """The hardware fingerprint id of a run, as its summary has it."""
    return fingerprint_id(hardware_fingerprint(start))


def declares_new_baseline(start: RunStartEvent | None) -> bool:
    return start is not None and start.tags.get(NEW_BASELINE_TAG, "").lower() in ("1", "true", "yes")


def run_record(events: Iterable[TelemetryEvent]) -> RunRecord:
    """The record of one recorded run (its run_start and run_end)."""
    start: RunStartEvent | None = None
    end: RunEndEvent | None = None
    run_id, first = "", None
    for event in events:
        run_id = run_id or event.run_id
        first = event.ts if first is None else min(first, event.ts)
        if isinstance(event, RunStartEvent):
            start = event
        elif isinstance(event, RunEndEvent):
            end = event
    return RunRecord(
        run_id=run_id,
        baseline_key=start.baseline_key if start else None,
        fingerprint=run_fingerprint(start),
        started_at=start.ts if start else first,
        status=end.status if end is not None else "running",
        new_baseline=declares_new_baseline(start),
    )


def select_baseline_runs(
    run: RunRecord, candidates: Iterable[RunRecord], *, window_days: float, max_runs: int
) -> list[RunRecord]:
    """The runs whose band ``run`` is compared with, oldest first: the newest ``max_runs`` of its
    history (``check.select_history``, the gate's own rule)."""
    history = select_history(run, candidates, BaselineConfig(window_days=window_days))
    return history[-max_runs:] if max_runs > 0 else []
