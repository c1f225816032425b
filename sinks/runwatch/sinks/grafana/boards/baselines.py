"""The Baselines dashboard: a run against the history of its baseline key: bands, outliers, history, and
the commits and level shifts that mark it."""

from __future__ import annotations

from runwatch.detectors.baselines.compare import METRICS, PREFIXED, BaselineConfig, MetricSpec
from runwatch.sinks.grafana.specs import AnnotationSpec, DashboardSpec, PanelSpec
from runwatch.sinks.grafana.sql_fragments import (
    BASELINE_KEY,
    METRIC_VAR,
    RUN_VAR,
    SUMMARY_METRIC_VAR,
)

_DEFAULTS = BaselineConfig()
WINDOW_DAYS = int(_DEFAULTS.window_days)
BAND_MAX_RUNS = 20  # BaselineReads.band's default
BAND_MAX_BUCKETS = 2000

# The run itself, and when its history starts: its window, or the latest new baseline declared
# before it (check.select_history's rule). Empty for a run without a summary or baseline key.
_ME = (
    "me AS (\n"
    "  SELECT r.run_id AS run_id, any(r.baseline_key) AS baseline_key, any(r.fingerprint) AS fingerprint,\n"
    "         any(r.started_at) AS started_at, any(r.new_baseline) AS new_baseline,\n"
    f"         greatest(any(r.started_at) - INTERVAL {WINDOW_DAYS} DAY,\n"
    "                  maxIf(d.started_at, d.new_baseline AND d.run_id != r.run_id "
    "AND d.started_at <= r.started_at))\n"
    "           AS since\n"
    "  FROM (SELECT * FROM {db}.run_summaries FINAL WHERE run_id = ${run:sqlstring} AND baseline_key != '') "
    "AS r\n"
    "  INNER JOIN (SELECT * FROM {db}.run_summaries FINAL) AS d\n"
    "    ON d.baseline_key = r.baseline_key AND d.fingerprint = r.fingerprint\n"
    "  GROUP BY r.run_id\n"
    ")"
)
_HISTORY = (
    "history AS (\n"
    "  SELECT s.run_id AS run_id, s.started_at AS started_at, s.metrics AS metrics\n"
    "  FROM (SELECT * FROM {db}.run_summaries FINAL) AS s CROSS JOIN me\n"
    "  WHERE s.baseline_key = me.baseline_key AND s.fingerprint = me.fingerprint AND s.status = 'completed'\n"
    "    AND s.run_id != me.run_id AND NOT me.new_baseline AND s.started_at >= me.since\n"
    "    AND s.started_at < me.started_at\n"
    ")"
)
_BAND_VALUES = (
    "[('loss', loss), ('grad_norm', grad_norm), ('step_time_s', step_time_s),\n"
    "             ('memory_allocated', JSONExtract(payload, 'memory', 'allocated', 'Nullable(Float64)')),\n"
    "             ('memory_peak', JSONExtract(payload, 'memory', 'peak', 'Nullable(Float64)')),\n"
    "             ('memory_host_rss', JSONExtract(payload, 'memory', 'host_rss', 'Nullable(Float64)'))]"
)
BASELINE_BAND = PanelSpec(
    "Run against its baseline band",
    "timeseries",
    f"WITH {_ME},\n{_HISTORY},\n"
    "band_runs AS (SELECT run_id FROM history ORDER BY started_at DESC, run_id DESC "
    f"LIMIT {BAND_MAX_RUNS}),\n"
    "per_step AS (\n"
    "  SELECT run_id, step, argMax(v, ts) AS value, max(ts) AS at FROM (\n"
    "    SELECT run_id, ts, assumeNotNull(step) AS step, pair.2 AS v FROM {db}.telemetry FINAL\n"
    f"    ARRAY JOIN {_BAND_VALUES} AS pair\n"
    "    WHERE pair.1 = ${metric:sqlstring} AND rank = 0 AND kind = 'step' AND step IS NOT NULL\n"
    "      AND (run_id IN (SELECT run_id FROM band_runs) OR run_id = ${run:sqlstring}))\n"
    "  WHERE v IS NOT NULL AND isFinite(assumeNotNull(v)) GROUP BY run_id, step\n"
    "),\n"
    "bucketing AS (\n"
    f"  SELECT toInt64(greatest(1, ceil((max(step) + 1) / {BAND_MAX_BUCKETS}))) AS b FROM per_step\n"
    "  WHERE run_id != ${run:sqlstring}\n"
    "),\n"
    "band AS (\n"
    "  SELECT intDiv(step, bucketing.b) * bucketing.b AS bucket, "
    "quantilesExactInclusive(0.1, 0.5, 0.9)(value) AS q\n"
    "  FROM per_step CROSS JOIN bucketing WHERE run_id != ${run:sqlstring} GROUP BY bucket\n"
    "),\n"
    "mine AS (\n"
    "  SELECT intDiv(step, bucketing.b) * bucketing.b AS bucket, min(at) AS time, avg(value) AS value\n"
    "  FROM per_step CROSS JOIN bucketing WHERE run_id = ${run:sqlstring} GROUP BY bucket\n"
    ")\n"
    "SELECT mine.time AS time, mine.value AS run, band.q[1] AS band_p10, band.q[2] AS band_median,\n"
    "       band.q[3] AS band_p90\n"
    "FROM mine INNER JOIN band ON band.bucket = mine.bucket WHERE $__timeFilter(mine.time) ORDER BY time",
    ("time", "run", "band_p10", "band_median", "band_p90"),
    f"The run's ${{metric}} (rank 0) at each step against the 10th-90th percentile band of the same step "
    f"in its baseline runs: the newest {BAND_MAX_RUNS} completed runs of the same baseline key and "
    f"hardware fingerprint that started in the {WINDOW_DAYS} days before it (or since a declared new "
    "baseline), as BaselineReads.band computes it. Drawn at the run's own time of each step.",
    width=24,
    height=10,
)


def _spec_sql(field_name: str) -> str:
    """A ClickHouse expression giving the comparison spec's ``field_name`` for ``metric``
    (compare.METRICS, then the PREFIXED families), or NULL for a metric runwatch does not judge."""

    def value(spec: MetricSpec) -> str:
        v = getattr(spec, field_name)
        if isinstance(v, bool):
            return "1" if v else "0"
        if isinstance(v, str):
            return f"'{v}'"
        return "NULL" if v is None else repr(float(v))

    arms = [f"metric = '{name}', {value(spec)}" for name, spec in METRICS.items()]
    arms += [f"startsWith(metric, '{prefix}'), {value(spec)}" for prefix, spec in PREFIXED.items()]
    return "multiIf(" + ", ".join(arms) + ", NULL)"


BASELINE_OUTLIERS = PanelSpec(
    "Outliers against the baseline",
    "table",
    f"WITH {_ME},\n{_HISTORY},\n"
    "specs AS (\n"
    "  SELECT metric, value,\n"
    f"         {_spec_sql('direction')} AS direction,\n"
    f"         {_spec_sql('min_change')} AS min_change,\n"
    f"         {_spec_sql('minimum')} AS minimum,\n"
    f"         {_spec_sql('exclusive_minimum')} AS exclusive_minimum\n"
    "  FROM (SELECT kv.1 AS metric, kv.2 AS value FROM {db}.run_summaries FINAL\n"
    "        ARRAY JOIN CAST(metrics, 'Array(Tuple(String, Float64))') AS kv "
    "WHERE run_id = ${run:sqlstring})\n"
    "  WHERE direction IS NOT NULL\n"
    "),\n"
    "valid AS (\n"
    "  SELECT specs.metric AS metric, h.metrics[specs.metric] AS v FROM specs CROSS JOIN history AS h\n"
    "  WHERE mapContains(h.metrics, specs.metric) AND isFinite(v)\n"
    "    AND (specs.minimum IS NULL "
    "OR if(specs.exclusive_minimum = 1, v > specs.minimum, v >= specs.minimum))\n"
    "),\n"
    "medians AS (SELECT metric, count() AS n, quantileExactInclusive(0.5)(v) AS median FROM valid "
    "GROUP BY metric),\n"
    "spreads AS (\n"
    f"  SELECT valid.metric AS metric, {1.4826} * quantileExactInclusive(0.5)(abs(valid.v - medians.median)) "
    "AS sigma\n"
    "  FROM valid INNER JOIN medians ON medians.metric = valid.metric GROUP BY valid.metric\n"
    "),\n"
    "judged AS (\n"
    "  SELECT specs.metric AS metric, specs.value AS value, specs.direction AS direction,\n"
    "         specs.min_change AS min_change, medians.n AS n, medians.median AS median,\n"
    f"         medians.median - {_DEFAULTS.band_sigmas} * spreads.sigma AS low,\n"
    f"         medians.median + {_DEFAULTS.band_sigmas} * spreads.sigma AS high,\n"
    "         if(abs(medians.median) > 0, (specs.value - medians.median) / abs(medians.median),\n"
    "            if(specs.value = medians.median, 0, if(specs.value > 0, inf, -inf))) AS change,\n"
    "         isFinite(specs.value) AND (specs.minimum IS NULL OR if(specs.exclusive_minimum = 1,\n"
    "            specs.value > specs.minimum, specs.value >= specs.minimum)) AS value_ok\n"
    "  FROM specs LEFT JOIN medians ON medians.metric = specs.metric LEFT JOIN spreads "
    "ON spreads.metric = specs.metric\n"
    "  SETTINGS join_use_nulls = 1\n"
    ")\n"
    "SELECT metric, value AS last, median AS baseline, low, high, round(change, 4) AS change, n,\n"
    "       multiIf(NOT value_ok, 'INVALID',\n"
    f"               coalesce(n, 0) < {_DEFAULTS.min_runs}, 'insufficient_history',\n"
    "               if(direction = 'lower_is_better', value > high AND change > min_change,\n"
    "                  value < low AND -change > min_change), 'OUTLIER', 'normal') AS verdict\n"
    "FROM judged ORDER BY verdict = 'OUTLIER' DESC, metric",
    ("metric", "last", "baseline", "low", "high", "change", "n", "verdict"),
    "Each judged figure of the run's summary against the same figure in its history (the same rule as "
    "`runwatch baseline check` with the default settings: "
    f"median +- {_DEFAULTS.band_sigmas:g} robust sigmas, "
    f"on the worse side, by more than the metric's minimum change; fewer than {_DEFAULTS.min_runs} valid "
    f"runs is insufficient_history; {WINDOW_DAYS}-day window).",
    width=24,
    height=10,
    cannot_show="Per-metric tolerances set in a YAML config (baseline.min_change) and a window or min_runs "
    "other than the defaults are not known to the dashboard: `runwatch baseline check RUN_ID` "
    "applies them.",
)
BASELINE_HISTORY = PanelSpec(
    "History of the summary metric",
    "timeseries",
    "SELECT started_at AS time, fingerprint, metrics[${summary_metric:sqlstring}] AS value\n"
    "FROM {db}.run_summaries FINAL\n"
    "WHERE if(baseline_key = '', '(none)', baseline_key) IN (${baseline_key:sqlstring})\n"
    "  AND mapContains(metrics, ${summary_metric:sqlstring}) AND $__timeFilter(started_at)\n"
    "ORDER BY time",
    ("time", "fingerprint", "value"),
    "One point per run (at its start) of the chosen summary figure, per hardware fingerprint; the "
    "Commits annotation names the code each run was.",
    width=24,
)
BASELINE_RUNS = PanelSpec(
    "Runs of the job",
    "table",
    "SELECT started_at AS time, run_id, git_sha, fingerprint, status, new_baseline\n"
    "FROM {db}.run_summaries FINAL\n"
    "WHERE if(baseline_key = '', '(none)', baseline_key) IN (${baseline_key:sqlstring}) "
    "AND $__timeFilter(started_at)\n"
    "ORDER BY time DESC",
    ("time", "run_id", "git_sha", "fingerprint", "status", "new_baseline"),
    "The job's run summaries (what the baseline is chosen from).",
    width=24,
)

COMMIT_MARKS = AnnotationSpec(
    "Commits",
    "SELECT time, concat('commit ', substring(git_sha, 1, 12), ' first run ', run_id) AS text,\n"
    "       ['commit', substring(git_sha, 1, 12)] AS tags FROM (\n"
    "  SELECT started_at AS time, run_id, git_sha,\n"
    "         lagInFrame(git_sha, 1, '') OVER (PARTITION BY fingerprint ORDER BY started_at, run_id\n"
    "                                          ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) "
    "AS previous\n"
    "  FROM {db}.run_summaries FINAL\n"
    "  WHERE if(baseline_key = '', '(none)', baseline_key) IN (${baseline_key:sqlstring}) AND git_sha != ''\n"
    ") WHERE git_sha != previous AND $__timeFilter(time) ORDER BY time",
    "blue",
)
LEVEL_SHIFT_MARKS = AnnotationSpec(
    "Level shifts (SQL estimate)",
    "SELECT time, concat(${summary_metric:sqlstring}, ' moved ', toString(round(100 * shift, 1)),\n"
    "              '% at commit ', substring(git_sha, 1, 12), ' (run ', run_id, ')') AS text,\n"
    "       ['level shift', substring(git_sha, 1, 12)] AS tags FROM (\n"
    "  SELECT started_at AS time, run_id, git_sha,\n"
    "         (median(v) OVER w_after - median(v) OVER w_before) / abs(median(v) OVER w_before) AS shift,\n"
    "         count() OVER w_before AS n_before, count() OVER w_after AS n_after\n"
    "  FROM (SELECT started_at, run_id, git_sha, fingerprint, metrics[${summary_metric:sqlstring}] AS v\n"
    "        FROM {db}.run_summaries FINAL\n"
    "        WHERE if(baseline_key = '', '(none)', baseline_key) IN (${baseline_key:sqlstring})\n"
    "          AND status = 'completed' AND mapContains(metrics, ${summary_metric:sqlstring}) "
    "AND isFinite(v))\n"
    "  WINDOW w_before AS (PARTITION BY fingerprint ORDER BY started_at, run_id ROWS BETWEEN 5 PRECEDING "
    "AND 1 PRECEDING),\n"
    "         w_after AS (PARTITION BY fingerprint ORDER BY started_at, run_id ROWS BETWEEN CURRENT ROW "
    "AND 4 FOLLOWING)\n"
    ") WHERE n_before >= 3 AND n_after >= 3 AND abs(shift) >= 0.10 AND $__timeFilter(time) ORDER BY time",
    "yellow",
)

BASELINES_DASHBOARD = DashboardSpec(
    "runwatch-baselines",
    "runwatch / Baselines",
    "A run against its job's history: the per-step band, the summary verdicts, and where levels changed.",
    "now-30d",
    (BASELINE_KEY, RUN_VAR, METRIC_VAR, SUMMARY_METRIC_VAR),
    (
        ("The run against its baseline", (BASELINE_BAND, BASELINE_OUTLIERS)),
        ("The job's history", (BASELINE_HISTORY, BASELINE_RUNS)),
    ),
    (COMMIT_MARKS, LEVEL_SHIFT_MARKS),
    refresh="5m",
)
