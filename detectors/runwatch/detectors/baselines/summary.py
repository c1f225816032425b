"""One row per run: what it was (code, hardware, config, data) and its figures, for comparing it
with the history of its job (``compare.py``).

``RunSummarizer`` is fed a run's events in order: ``run_start``, every rank's steps, evals, action
acks, ``run_end``, and the anomalies found. Rank 0's steps make the step figures (step time, rates,
losses: in a synchronous data-parallel run every rank waits for the slowest, so rank 0's step time
is the run's); the memory maxima are every rank's. It keeps O(1) state per
metric (streaming quantiles for the step-time median and p95, maxima, sums), so the worker can keep
one per run and the offline ingest uses the same code. Its state pickles.

The figures (``RunSummary.metrics``, names as ``compare.METRICS`` judges them):
training time (run start to end, or to the last event), steps, median and p95 step time, the
median samples/s, tokens/s and MFU, the data-wait share of step time, the maxima of CUDA
allocated / reserved / peak and host RSS, the loss at every ``loss_every``-th step
(``loss_at_step_N``; a step replayed after a rollback keeps its newest value), the final loss (the
median of the last ``FINAL_LOSS_STEPS`` losses, so one noisy last step does not decide it), the last
and best validation loss, each category's last mean loss (``category_loss_<name>``), anomalies per
detector (``anomalies_<detector>``) and the rollbacks applied.

The hardware fingerprint is what makes step times comparable: GPU names and count, world size,
torch and CUDA versions, and the CPU model where ``run_start``'s tags carry one (``cpu_model``); a
``hardware`` tag replaces it all (a declared fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections import deque
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field
from river import stats

from runwatch.contract.schema import (
    ActionAckEvent,
    Anomaly,
    CategoryLoss,
    EvalEvent,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
    TelemetryEvent,
)

FINAL_LOSS_STEPS = 10
NEW_BASELINE_TAG = "new_baseline"  # run_start tag: "true" declares this run the start of a new baseline
COMMIT_TIME_TAG = "git_commit_time"  # run_start tag: the commit's time, ISO 8601
Status = Literal["completed", "failed", "stopped", "interrupted", "died", "running"]


class RunSummary(BaseModel):
    """The ``run_summaries`` row of one run."""

    run_id: str
    baseline_key: str | None = None
    git_sha: str | None = None
    git_dirty: bool | None = None
    commit_time: datetime | None = None
    fingerprint: str = Field(description="a short hash of fingerprint_parts")
    fingerprint_parts: dict[str, str] = Field(default_factory=dict)
    config_hash: str | None = None
    dataset_version: str | None = None
    new_baseline: bool = Field(
        default=False, description="declared a new baseline: earlier runs are not its history"
    )
    started_at: datetime | None = None
    ended_at: datetime | None = None
    status: Status = "running"
    metrics: dict[str, float | None] = Field(default_factory=dict)


def hardware_fingerprint(start: RunStartEvent | None) -> dict[str, str]:
    """What must match for two runs' speed and memory to be comparable."""
    if start is None:
        return {}
    if "hardware" in start.tags:
        return {"hardware": start.tags["hardware"]}
    names = sorted(start.gpu_names)
    parts = {
        "gpus": ",".join(names) if names else "none",
        "gpu_count": str(len(names)),
        "world_size": str(start.world_size),
        "torch": start.torch_version or "",
        "cuda": start.cuda_version or "",
    }
    if "cpu_model" in start.tags:
        parts["cpu_model"] = start.tags["cpu_model"]
    return parts


def fingerprint_id(parts: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class RunSummarizer:
    """Accumulates one run's summary (see the module doc). Pure; pickles."""

    # The latest step's category losses, not yet copied into ``_category`` (a class default: a summarizer
    # pickled before it existed has none waiting).
    _latest_categories: dict[str, CategoryLoss] | None = None

    def __init__(self, run_id: str, loss_every: int = 100):
        if loss_every < 1:
            raise ValueError("loss_every must be at least 1")
        self.run_id = run_id
        self.loss_every = loss_every
        self.start: RunStartEvent | None = None
        self.first_ts: datetime | None = None
        self.last_ts: datetime | None = None
        self.end: RunEndEvent | None = None
        self.steps = 0
        self._step_time_median = stats.Quantile(0.5)
        self._step_time_p95 = stats.Quantile(0.95)
        self._rates: dict[str, stats.Quantile] = {}  # samples_per_s, tokens_per_s, mfu -> running median
        self._step_time_sum = 0.0
        self._data_wait_sum = 0.0
        self._maxima: dict[str, float] = {}
        self._loss_at: dict[int, float] = {}
        self._last_losses: deque[float] = deque(maxlen=FINAL_LOSS_STEPS)
        self._last_eval: float | None = None
        self._best_eval: float | None = None
        self._category: dict[str, float] = {}
        self._anomalies: dict[str, int] = {}
        self._rollbacks: set[str] = set()

    def observe(self, event: TelemetryEvent) -> None:
        if self.first_ts is None or event.ts < self.first_ts:
            self.first_ts = event.ts
        if self.last_ts is None or event.ts > self.last_ts:
            self.last_ts = event.ts
        if isinstance(event, StepEvent):
            if event.rank == 0:
                self._step(event)
            self._memory(event)  # the run's memory maxima are every rank's
        elif isinstance(event, EvalEvent):
            self._eval(event)
        elif isinstance(event, RunStartEvent):
            self.start = event
        elif isinstance(event, RunEndEvent):
            self.end = event
        elif isinstance(event, ActionAckEvent):
            if event.action_kind == "rollback" and event.outcome == "applied":
                self._rollbacks.add(event.action_id)  # every rank acks the same rollback

    def add_anomaly(self, anomaly: Anomaly) -> None:
        self._anomalies[anomaly.detector] = self._anomalies.get(anomaly.detector, 0) + 1

    def _step(self, event: StepEvent) -> None:
        self.steps += 1
        step_time = event.step_time_s
        if step_time is not None and step_time > 0:
            self._step_time_median.update(step_time)
            self._step_time_p95.update(step_time)
            self._step_time_sum += step_time
            if event.data_wait_s is not None:
                self._data_wait_sum += event.data_wait_s
        # Each rate by name, not a loop over the names with getattr: this runs on every step.
        if event.samples_per_s is not None:
            self._rate("samples_per_s").update(event.samples_per_s)
        if event.tokens_per_s is not None:
            self._rate("tokens_per_s").update(event.tokens_per_s)
        if event.mfu is not None:
            self._rate("mfu").update(event.mfu)
        loss = event.loss
        if loss is not None and math.isfinite(loss):
            self._last_losses.append(loss)
            if event.step % self.loss_every == 0:
                self._loss_at[event.step] = loss
        if event.category_loss:
            self._note_categories(event.category_loss)

    def _rate(self, name: str) -> stats.Quantile:
        """The running median of rate ``name``, made at its first value."""
        rate = self._rates.get(name)
        if rate is None:  # (not setdefault: that would build a quantile on every step)
            rate = self._rates[name] = stats.Quantile(0.5)
        return rate

    def _note_categories(self, categories: dict[str, CategoryLoss]) -> None:
        """Keep each category's last mean loss. A step with the same categories as the one before replaces
        all of its means, so that step's are copied into ``_category`` only when the names change (and read
        by ``metrics``): a copy per step cost more than the rest of the step's figures together."""
        latest = self._latest_categories
        if latest is not None and latest.keys() != categories.keys():
            self._category.update(_means(latest))
        self._latest_categories = categories

    def _memory(self, event: StepEvent) -> None:
        memory = event.memory
        if memory is None:
            return
        # (four calls, not a loop over four (name, value) tuples built on every step)
        maxima = self._maxima
        _raise_max(maxima, "max_cuda_allocated_bytes", memory.allocated)
        _raise_max(maxima, "max_cuda_reserved_bytes", memory.reserved)
        _raise_max(maxima, "max_cuda_peak_bytes", memory.peak)
        _raise_max(maxima, "max_host_rss_bytes", memory.host_rss)

    def _eval(self, event: EvalEvent) -> None:
        if event.split != "val" or event.loss is None or not math.isfinite(event.loss):
            return
        self._last_eval = event.loss
        self._best_eval = event.loss if self._best_eval is None else min(self._best_eval, event.loss)

    def metrics(self) -> dict[str, float | None]:
        started = self.start.ts if self.start is not None else self.first_ts
        ended = self.end.ts if self.end is not None else self.last_ts
        has_times = self._step_time_sum > 0
        out: dict[str, float | None] = {
            "training_time_s": (ended - started).total_seconds() if started and ended else None,
            "steps": float(self.steps),
            "step_time_median_s": self._step_time_median.get() if has_times else None,
            "step_time_p95_s": self._step_time_p95.get() if has_times else None,
            "samples_per_s": _get(self._rates.get("samples_per_s")),
            "tokens_per_s": _get(self._rates.get("tokens_per_s")),
            "mfu": _get(self._rates.get("mfu")),
            "data_wait_share": self._data_wait_sum / self._step_time_sum if has_times else None,
            **{name: float(v) for name, v in self._maxima.items()},
            "final_loss": statistics.median(self._last_losses) if self._last_losses else None,
            "last_eval_loss": self._last_eval,
            "best_eval_loss": self._best_eval,
            "rollbacks": float(len(self._rollbacks)),
        }
        out.update({f"loss_at_step_{step}": loss for step, loss in sorted(self._loss_at.items())})
        categories = self._category
        if self._latest_categories is not None:
            categories = {**categories, **_means(self._latest_categories)}
        out.update({f"category_loss_{name}": loss for name, loss in sorted(categories.items())})
        out.update({f"anomalies_{name}": float(n) for name, n in sorted(self._anomalies.items())})
        return out

    def summary(self, status_if_not_ended: Status = "running") -> RunSummary:
        """The row as it stands; ``status_if_not_ended`` for a run with no ``run_end`` (``died`` once
        its heartbeats stopped)."""
        start = self.start
        parts = hardware_fingerprint(start)
        return RunSummary(
            run_id=self.run_id,
            baseline_key=start.baseline_key if start else None,
            git_sha=start.git_sha if start else None,
            git_dirty=start.git_dirty if start else None,
            fingerprint=fingerprint_id(parts),
            fingerprint_parts=parts,
            config_hash=start.config_hash if start else None,
            dataset_version=start.dataset_version if start else None,
            commit_time=_commit_time(start),
            new_baseline=start is not None
            and start.tags.get(NEW_BASELINE_TAG, "").lower() in ("1", "true", "yes"),
            started_at=start.ts if start else self.first_ts,
            ended_at=self.end.ts if self.end is not None else self.last_ts,
            status=self.end.status if self.end is not None else status_if_not_ended,
            metrics=self.metrics(),
        )


def _commit_time(start: RunStartEvent | None) -> datetime | None:
    raw = start.tags.get(COMMIT_TIME_TAG) if start is not None else None
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw)
    except ValueError:
        return None  # a malformed tag is not worth losing the summary over


def _raise_max(maxima: dict[str, float], name: str, value: int | None) -> None:
    if value is not None and (name not in maxima or value > maxima[name]):
        maxima[name] = value


def _means(categories: dict[str, CategoryLoss]) -> dict[str, float]:
    return {name: category.mean for name, category in categories.items()}


def _get(quantile: stats.Quantile | None) -> float | None:
    return None if quantile is None else quantile.get()
