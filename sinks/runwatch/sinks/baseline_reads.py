"""``BaselineReads``: the stored run summaries and per-step bands a run is compared with (``sink.baselines``;
issue 14: detectors/runwatch/detectors/baselines/)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from runwatch.sinks.rows import SUMMARY_COLUMNS, as_utc, summary_from_row

if TYPE_CHECKING:
    from runwatch.detectors.baselines.band import BaselineBand
    from runwatch.detectors.baselines.summary import RunSummary
    from runwatch.sinks.connection import Connection


class BaselineReads:
    def __init__(self, sink: Connection):
        self.query = sink.query

    def _summaries(
        self, where: str, parameters: dict[str, Any], order: str = "started_at, run_id"
    ) -> list[RunSummary]:
        rows = self.query(
            "SELECT " + ", ".join(SUMMARY_COLUMNS) + " FROM {db}.run_summaries FINAL "
            f"WHERE {where} ORDER BY {order}",
            parameters,
        )
        return [summary_from_row(r) for r in rows]

    def summary(self, run_id: str) -> RunSummary | None:
        """The stored summary of one run, or None."""
        found = self._summaries("run_id = %(r)s", {"r": run_id})
        return found[0] if found else None

    def candidates(
        self, baseline_key: str, fingerprint: str, before: datetime, window_days: float
    ) -> list[RunSummary]:
        """The summaries of ``baseline_key`` on ``fingerprint`` that started in the ``window_days``
        before ``before``, oldest first, whatever their status (the declared new baselines among them
        matter too): what ``detectors.baselines.check.select_history`` chooses a history from."""
        since = as_utc(before) - timedelta(days=window_days)
        return self._summaries(
            "baseline_key = %(k)s AND fingerprint = %(f)s AND started_at >= %(since)s "
            "AND started_at < %(before)s",
            {"k": baseline_key, "f": fingerprint, "since": since, "before": as_utc(before)},
        )

    def for_key(self, baseline_key: str, fingerprint: str | None = None) -> list[RunSummary]:
        """Every summary of ``baseline_key`` (on ``fingerprint`` when given), in start order: the
        history a change-point scan runs over."""
        if fingerprint is None:
            return self._summaries("baseline_key = %(k)s", {"k": baseline_key})
        return self._summaries(
            "baseline_key = %(k)s AND fingerprint = %(f)s", {"k": baseline_key, "f": fingerprint}
        )

    def band_runs(
        self,
        baseline_key: str,
        fingerprint: str,
        before: datetime,
        window_days: float,
        max_runs: int,
        exclude_run: str = "",
    ) -> list[str]:
        """The runs a band is made of, oldest first: the newest ``max_runs`` of the history the gate
        would choose for a run of ``baseline_key`` on ``fingerprint`` starting at ``before``
        (``check.select_history`` over ``baseline_candidates``)."""
        from runwatch.detectors.baselines.check import select_history
        from runwatch.detectors.baselines.compare import BaselineConfig
        from runwatch.detectors.baselines.summary import RunSummary

        probe = RunSummary(
            run_id=exclude_run, baseline_key=baseline_key, fingerprint=fingerprint, started_at=as_utc(before)
        )
        candidates = self.candidates(baseline_key, fingerprint, before, window_days)
        history = select_history(probe, candidates, BaselineConfig(window_days=window_days))
        return [r.run_id for r in history[-max_runs:]] if max_runs > 0 else []

    def band(
        self,
        baseline_key: str,
        fingerprint: str,
        before: datetime,
        window_days: float = 30.0,
        max_runs: int = 20,
        *,
        exclude_run: str = "",
        bucket_steps: int | None = None,
        max_buckets: int = 2000,
        quantiles: tuple[float, float, float] = (0.1, 0.5, 0.9),
    ) -> BaselineBand | None:
        """The per-step band of the baseline runs (``baseline_band_runs``); None without such runs."""
        runs = self.band_runs(baseline_key, fingerprint, before, window_days, max_runs, exclude_run)
        return self.band_of_runs(
            runs,
            baseline_key,
            fingerprint,
            bucket_steps=bucket_steps,
            max_buckets=max_buckets,
            quantiles=quantiles,
        )

    def band_of_runs(
        self,
        runs: Sequence[str],
        baseline_key: str,
        fingerprint: str,
        *,
        bucket_steps: int | None = None,
        max_buckets: int = 2000,
        quantiles: tuple[float, float, float] = (0.1, 0.5, 0.9),
    ) -> BaselineBand | None:
        """The per-step band of ``runs`` computed from their stored telemetry, as
        ``band.band_from_runs`` computes it from their events; None for no runs. Steps are bucketed
        so that there are at most ``max_buckets`` per metric unless ``bucket_steps`` is given."""
        from runwatch.detectors.baselines.band import BaselineBand, MetricBand, bucket_steps_for

        runs = list(runs)
        if not runs:
            return None
        if bucket_steps is None:
            last = self.query(
                "SELECT max(step) FROM {db}.telemetry FINAL WHERE run_id IN %(runs)s AND rank = 0 "
                "AND kind IN ('step', 'eval')",
                {"runs": runs},
            )
            bucket_steps = bucket_steps_for(int(last[0][0] or 0) if last else 0, max_buckets)
        q0, q1, q2 = quantiles
        rows = self.query(_BAND_SQL, {"runs": runs, "b": int(bucket_steps), "q0": q0, "q1": q1, "q2": q2})
        metrics: dict[str, MetricBand] = {}
        for metric, bucket, q, n in rows:
            band = metrics.get(metric)
            if band is None:
                band = metrics[metric] = MetricBand(steps=[], lo=[], mid=[], hi=[], runs=[])
            band.steps.append(int(bucket))
            band.lo.append(float(q[0]))
            band.mid.append(float(q[1]))
            band.hi.append(float(q[2]))
            band.runs.append(int(n))
        return BaselineBand(
            baseline_key=baseline_key,
            fingerprint=fingerprint,
            run_ids=runs,
            quantiles=quantiles,
            bucket_steps=bucket_steps,
            metrics=metrics,
        )


# Rank 0's per-step values of the baseline runs, one per (run, metric, step) (the newest: a step
# replayed after a rollback counts once), pooled per step bucket into R-7 quantiles
# (quantileExactInclusive), as detectors/runwatch/detectors/baselines/band.py does in Python.
_BAND_SQL = """
SELECT metric, intDiv(step, %(b)s) * %(b)s AS bucket,
       quantilesExactInclusive(%(q0)s, %(q1)s, %(q2)s)(value) AS q, uniqExact(run_id) AS runs
FROM (
    SELECT run_id, metric, step, argMax(v, ts) AS value
    FROM (
        SELECT run_id, ts, assumeNotNull(step) AS step, pair.1 AS metric, pair.2 AS v
        FROM {db}.telemetry FINAL
        ARRAY JOIN arrayConcat(
            [('loss', loss), ('grad_norm', grad_norm), ('step_time_s', step_time_s),
             ('memory_allocated', JSONExtract(payload, 'memory', 'allocated', 'Nullable(Float64)')),
             ('memory_peak', JSONExtract(payload, 'memory', 'peak', 'Nullable(Float64)')),
             ('memory_host_rss', JSONExtract(payload, 'memory', 'host_rss', 'Nullable(Float64)'))],
            arrayMap(kv -> (concat('module_grad_norm/', kv.1), kv.2),
                     JSONExtractKeysAndValues(payload, 'module_grad_norms', 'Nullable(Float64)'))
        ) AS pair
        WHERE run_id IN %(runs)s AND rank = 0 AND kind = 'step' AND step IS NOT NULL
        UNION ALL
        SELECT run_id, ts, assumeNotNull(step) AS step, \
concat('eval_loss/', JSONExtractString(payload, 'split'))
               AS metric, loss AS v
        FROM {db}.telemetry FINAL
        WHERE run_id IN %(runs)s AND rank = 0 AND kind = 'eval' AND step IS NOT NULL
    )
    WHERE v IS NOT NULL AND isFinite(assumeNotNull(v))
    GROUP BY run_id, metric, step
)
GROUP BY metric, bucket
ORDER BY metric, bucket
"""
