"""Change points in a metric's history: E-divisive means (Matteson and James, 2014), as Apache Otava
does it, and the first run / commit at which a summary metric's level changed.

``scan`` splits a series recursively where the energy-statistic divergence between the part before
and the part after is largest (``qhat``, maximised over the split and the end of the part after, as
Otava's ``PairDistanceCalculator`` does), and keeps a split while a permutation test (the points
shuffled within each current segment, ``permutations`` times, from a seeded generator so a scan is
reproducible) says it is significant: p = (permuted qhats >= qhat) / (permutations + 1), as both
Otava and MongoDB's signal-processing-algorithms compute it. Like Otava's merge step, change points
whose relative change of the mean is below ``min_magnitude`` are then dropped, weakest first, and
their neighbours' statistics recomputed.

Why not the library: the issue asks for ``apache-otava`` or ``signal-processing-algorithms``.
Neither installs beside runwatch's stack (checked with ``pip install --dry-run`` against numpy 2.4,
scipy 1.17, torch 2.13): apache-otava 0.8.0 pins numpy==2.2.0 and scipy<1.17 and brings a CLI's
worth of services (BigQuery, Postgres, Slack, Graphite clients); signal-processing-algorithms
2.1.6 needs numpy<2 (and pins setuptools 70, gevent). The algorithm is some sixty lines of numpy,
written here from Otava's ``change_point_divisive`` (``calculator.py``, ``detector.py``,
``significance_test.py``) and checked against its definition of qhat.

Pure: values in, change points out; O(n^2) time and memory per pass over a series of n runs, and
a significant split costs ``permutations`` passes (a job's history over a window is tens to
hundreds of runs: milliseconds to a few seconds per metric; a test that fails stops early).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from runwatch.detectors.baselines.compare import BaselineConfig, MetricSpec, is_valid, metric_spec
from runwatch.detectors.baselines.summary import RunSummary

FloatArray = NDArray[np.float64]

DEFAULT_MAX_PVALUE = 0.01
DEFAULT_PERMUTATIONS = 199


@dataclass(frozen=True)
class ChangePoint:
    """A level change: ``values[index]`` is the first value of the new level."""

    index: int
    mean_before: float  # of the segment before (since the previous change point)
    mean_after: float  # of the segment after (until the next change point)
    relative_change: float  # (mean_after - mean_before) / |mean_before|
    pvalue: float
    qhat: float


# -- E-divisive means ------------------------------------------------------------------------------


def _best_split(z: FloatArray, power: float) -> tuple[int, float]:
    """The split ``tau`` (1 <= tau < len(z)) of ``z`` that maximises qhat over every end ``kappa``
    of the part after, and that qhat (Otava's ``PairDistanceCalculator.get_candidate_change_point``).

    qhat(X, Y) = 2/(m+n) sum|X_i - Y_j| - 2m/((m+n)(n-1)) sum_{i<k}|X_i - X_k|
                 - 2n/((m+n)(m-1)) sum_{j<k}|Y_j - Y_k|,  X = z[:tau] (n), Y = z[tau:kappa] (m).
    """
    length = len(z)
    d = np.abs(z[:, None] - z[None, :])
    if power != 1.0:
        d **= power
    s = d.cumsum(axis=0).cumsum(axis=1)  # s[a - 1, b - 1] = d[:a, :b].sum()
    diag = np.diagonal(s)  # diag[a - 1]: the sum over z[:a] x z[:a] (twice the sum over its pairs)
    # Rows tau = 1..length-1, columns kappa = 2..length; d is symmetric with a zero diagonal, so
    # sum|X_i - Y_j| = s[tau, kappa] - s[tau, tau], and the pairs within Y sum to
    # (s[kappa, kappa] - 2 s[tau, kappa] + s[tau, tau]) / 2, in s's 1-based prefix notation.
    s_tk = s[:-1, 1:]
    d_t = diag[:-1, None]
    d_k = diag[None, 1:]
    tau = np.arange(1, length, dtype=np.float64)[:, None]
    kappa = np.arange(2, length + 1, dtype=np.float64)[None, :]
    n = tau
    m = kappa - tau
    between = s_tk - d_t
    within_x = d_t / 2
    within_y = (d_k - 2 * s_tk + d_t) / 2
    # a one-point part has no pairs (its sum is 0): any finite coefficient will do
    q = (2 * between - 2 * m / np.maximum(n - 1, 1) * within_x - 2 * n / np.maximum(m - 1, 1) * within_y) / (
        m + n
    )
    q = np.where(m > 0, q, -np.inf)
    i, _ = np.unravel_index(int(np.argmax(q)), q.shape)
    return int(i) + 1, float(q.max())


def _segments(bounds: Sequence[int], length: int) -> list[tuple[int, int]]:
    edges = [0, *sorted(bounds), length]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def _candidate(series: FloatArray, bounds: Sequence[int], power: float) -> tuple[int, float] | None:
    """The best split over every current segment of at least two points: (index, qhat)."""
    best: tuple[int, float] | None = None
    for a, b in _segments(bounds, len(series)):
        if b - a < 2:
            continue
        tau, qhat = _best_split(series[a:b], power)
        if best is None or qhat > best[1]:
            best = (a + tau, qhat)
    return best


def _pvalue(
    series: FloatArray,
    bounds: Sequence[int],
    qhat: float,
    permutations: int,
    power: float,
    rng: np.random.Generator,
    max_pvalue: float,
) -> float:
    """Otava's ``PermutationsSignificanceTester``: shuffle within each segment, count the
    permuted best qhats at least as large. Stops as soon as the count makes the p-value exceed
    ``max_pvalue`` (the count only grows, so the verdict is the full test's; a split that is not
    significant ends the search, so nothing else changes either): in a series with no change
    that is a handful of permutations instead of all of them."""
    extreme = 0
    give_up = max_pvalue * (permutations + 1)
    for _ in range(permutations):
        shuffled = series.copy()
        for a, b in _segments(bounds, len(series)):
            rng.shuffle(shuffled[a:b])
        permuted = _candidate(shuffled, bounds, power)
        if permuted is not None and permuted[1] >= qhat:
            extreme += 1
            if extreme > give_up:
                break
    return extreme / (permutations + 1)


def _relative(before: float, after: float) -> float:
    if before == 0:
        return 0.0 if after == 0 else float(np.copysign(np.inf, after))
    return (after - before) / abs(before)


def _describe(series: FloatArray, found: dict[int, tuple[float, float]]) -> list[ChangePoint]:
    indexes = sorted(found)
    edges = [0, *indexes, len(series)]
    out = []
    for k, index in enumerate(indexes):
        before = float(series[edges[k] : index].mean())
        after = float(series[index : edges[k + 2]].mean())
        pvalue, qhat = found[index]
        out.append(ChangePoint(index, before, after, _relative(before, after), pvalue, qhat))
    return out


def scan(
    values: Sequence[float],
    *,
    max_pvalue: float = DEFAULT_MAX_PVALUE,
    permutations: int = DEFAULT_PERMUTATIONS,
    seed: int = 0,
    power: float = 1.0,
    min_magnitude: float = 0.0,
) -> list[ChangePoint]:
    """The change points of ``values`` (finite numbers, in time order), by index.

    ``max_pvalue``: a split is kept while its permutation p-value is at most this (with
    ``permutations`` shuffles the smallest p-value is 1/(permutations+1)). ``seed``: the
    permutations' generator, so that the same series always gives the same answer. ``power``:
    the distance exponent, in (0, 2). ``min_magnitude``: change points whose |relative change| of
    the mean is smaller are dropped afterwards (weakest first, neighbours recomputed)."""
    if not 0 < power < 2:
        raise ValueError("power must be in (0, 2)")
    if permutations < 1:
        raise ValueError("permutations must be at least 1")
    series = np.asarray(values, dtype=np.float64)
    if series.ndim != 1:
        raise ValueError("values must be one-dimensional")
    if not np.all(np.isfinite(series)):
        raise ValueError("values must be finite (leave invalid ones out before scanning)")
    rng = np.random.default_rng(seed)
    found: dict[int, tuple[float, float]] = {}  # index -> (pvalue, qhat)
    while True:
        candidate = _candidate(series, list(found), power)
        if candidate is None or candidate[1] <= 0:
            break
        index, qhat = candidate
        pvalue = _pvalue(series, list(found), qhat, permutations, power, rng, max_pvalue)
        if pvalue > max_pvalue:
            break
        found[index] = (pvalue, qhat)
    points = _describe(series, found)
    while points and min_magnitude > 0:
        weakest = min(points, key=lambda p: abs(p.relative_change))
        if abs(weakest.relative_change) >= min_magnitude:
            break
        del found[weakest.index]
        points = _describe(series, found)
    return points


# -- onto a job's run summaries ------------------------------------------------------------------

ChangeKind = Literal["regression", "improvement"]


@dataclass(frozen=True)
class LevelChange:
    """The first run (and commit) of a new level of one summary metric."""

    metric: str
    kind: ChangeKind  # by the metric's direction (compare.METRICS)
    run_id: str
    git_sha: str | None
    commit_time: datetime | None
    started_at: datetime | None
    previous_run_id: str | None  # the run before it in the series: the commit range is previous..this
    previous_sha: str | None
    fingerprint: str
    mean_before: float
    mean_after: float
    relative_change: float
    pvalue: float
    runs_scanned: int  # the series' length (runs with a valid value)


def _order(s: RunSummary) -> tuple[datetime, str]:
    return (s.started_at or datetime.min, s.run_id)


def baseline_segments(summaries: Sequence[RunSummary]) -> list[list[RunSummary]]:
    """``summaries`` (one baseline key) split by hardware fingerprint and then at every declared
    new baseline, each in start order: the histories a change point may be looked for in (a move
    to other hardware or a declared new baseline is no change of level). Completed runs only."""
    by_fingerprint: dict[str, list[RunSummary]] = {}
    for s in sorted(summaries, key=_order):
        if s.status == "completed":
            by_fingerprint.setdefault(s.fingerprint, []).append(s)
    out: list[list[RunSummary]] = []
    for runs in by_fingerprint.values():
        current: list[RunSummary] = []
        for s in runs:
            if s.new_baseline and current:
                out.append(current)
                current = []
            current.append(s)
        if current:
            out.append(current)
    return out


def level_changes(
    segment: Sequence[RunSummary],
    metric: str,
    spec: MetricSpec,
    *,
    min_magnitude: float,
    max_pvalue: float = DEFAULT_MAX_PVALUE,
    permutations: int = DEFAULT_PERMUTATIONS,
    seed: int = 0,
) -> list[LevelChange]:
    """The change points of ``metric`` over one history (in start order; runs whose value is
    missing or invalid are left out of the series)."""
    runs = [s for s in segment if is_valid(s.metrics.get(metric), spec)]
    values = [float(s.metrics[metric] or 0.0) for s in runs]
    if len(values) < 3:
        return []
    out = []
    for p in scan(
        values, max_pvalue=max_pvalue, permutations=permutations, seed=seed, min_magnitude=min_magnitude
    ):
        run, previous = runs[p.index], runs[p.index - 1]
        worse = p.relative_change > 0 if spec.direction == "lower_is_better" else p.relative_change < 0
        out.append(
            LevelChange(
                metric=metric,
                kind="regression" if worse else "improvement",
                run_id=run.run_id,
                git_sha=run.git_sha,
                commit_time=run.commit_time,
                started_at=run.started_at,
                previous_run_id=previous.run_id,
                previous_sha=previous.git_sha,
                fingerprint=run.fingerprint,
                mean_before=p.mean_before,
                mean_after=p.mean_after,
                relative_change=p.relative_change,
                pvalue=p.pvalue,
                runs_scanned=len(values),
            )
        )
    return out


def scan_history(
    summaries: Sequence[RunSummary],
    config: BaselineConfig | None = None,
    *,
    metrics: Sequence[str] | None = None,
    max_pvalue: float = DEFAULT_MAX_PVALUE,
    permutations: int = DEFAULT_PERMUTATIONS,
    seed: int = 0,
) -> list[LevelChange]:
    """Every level change of every judged metric (or of ``metrics``) in a baseline key's run
    summaries, per fingerprint and declared baseline (``baseline_segments``), ordered by metric and
    start time. A change smaller than the metric's minimum relative change (``config.min_change``
    or the built-in one) is not reported, as the gate would not call it an outlier either."""
    config = config or BaselineConfig()
    names = sorted({m for s in summaries for m in s.metrics}) if metrics is None else list(metrics)
    out: list[LevelChange] = []
    segments = baseline_segments(summaries)
    for metric in names:
        spec = metric_spec(metric)
        if spec is None:
            continue
        floor = config.min_change.get(metric, spec.min_change)
        for segment in segments:
            out.extend(
                level_changes(
                    segment,
                    metric,
                    spec,
                    min_magnitude=floor,
                    max_pvalue=max_pvalue,
                    permutations=permutations,
                    seed=seed,
                )
            )
    out.sort(key=lambda c: (c.metric, c.started_at or datetime.min, c.run_id))
    return out


def first_level_change(
    changes: Sequence[LevelChange], metric: str, kind: ChangeKind | None = "regression"
) -> LevelChange | None:
    """The earliest change of ``metric`` of ``kind`` (None: either) in ``changes``."""
    hits = [c for c in changes if c.metric == metric and (kind is None or c.kind == kind)]
    return min(hits, key=lambda c: (c.started_at or datetime.min, c.run_id), default=None)
