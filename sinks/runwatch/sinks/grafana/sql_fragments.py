"""The SQL every dashboard shares: the run and rank filters, a step's rows, the baseline key of a run, the
variables (baseline key, run, rank, metric) and the annotations (findings, actions, rollbacks)."""

from __future__ import annotations

from typing import Any

from runwatch.contract.action_kinds import ACTION_KINDS
from runwatch.sinks.grafana.specs import AnnotationSpec, PanelSpec, VariableSpec

RUN = "run_id = ${run:sqlstring}"
RANKS = "rank IN (${rank:sqlstring})"
SERIES = "concat('rank ', toString(rank)) AS series"
STEP_ROWS = f"FROM {{db}}.telemetry FINAL WHERE {RUN} AND kind = 'step' AND {RANKS} AND $__timeFilter(ts)"
# A run's baseline key as the variable lists it ('(none)' for a run without one).
KEY_OF_RUN_START = (
    "if(JSONExtractString(payload, 'baseline_key') = '', '(none)', "
    "JSONExtractString(payload, 'baseline_key'))"
)
RUNS_OF_KEY = (
    f"run_id IN (SELECT run_id FROM {{db}}.telemetry WHERE kind = 'run_start' "
    f"AND {KEY_OF_RUN_START} IN (${{baseline_key:sqlstring}}))"
)
PHASES = ("train", "eval", "checkpoint", "dataload", "idle")


def payload(path: str, kind: str = "Nullable(Float64)") -> str:
    keys = ", ".join(f"'{k}'" for k in path.split("."))
    return f"JSONExtract(payload, {keys}, '{kind}')"


def step_panel(title: str, columns: dict[str, str], description: str, unit: str = "", **kw: Any) -> PanelSpec:
    """A per-step time series of the selected ranks: one series per rank and column."""
    select = ", ".join(f"{expr} AS {name}" for name, expr in columns.items())
    sql = f"SELECT ts AS time, {SERIES}, {select}\n{STEP_ROWS}\nORDER BY time"
    return PanelSpec(title, "timeseries", sql, ("time", "series", *columns), description, unit, **kw)


# -- variables ----------------------------------------------------------------------------------

BASELINE_KEY = VariableSpec(
    "baseline_key",
    "Baseline key",
    sql=(
        "SELECT DISTINCT key FROM (\n"
        f"  SELECT {KEY_OF_RUN_START} AS key FROM {{db}}.telemetry WHERE kind = 'run_start' "
        "AND $__timeFilter(ts)\n"
        "  UNION ALL\n"
        "  SELECT if(baseline_key = '', '(none)', baseline_key) AS key FROM {db}.run_summaries FINAL\n"
        "  WHERE $__timeFilter(started_at)\n"
        ") ORDER BY key"
    ),
    multi=True,
    include_all=True,
    description="the job whose runs are listed ('(none)': runs published without a baseline key)",
)
RUN_VAR = VariableSpec(
    "run",
    "Run",
    sql=(
        f"SELECT run_id FROM {{db}}.telemetry WHERE $__timeFilter(ts) AND {RUNS_OF_KEY}\n"
        "GROUP BY run_id ORDER BY max(ts) DESC"
    ),
    description="runs of the baseline key with telemetry in the time range, newest first",
)
RANK_VAR = VariableSpec(
    "rank",
    "Rank",
    sql=f"SELECT DISTINCT rank FROM {{db}}.telemetry WHERE {RUN} AND $__timeFilter(ts) ORDER BY rank",
    multi=True,
    include_all=True,
    description="the run's ranks",
)
BAND_METRICS = ("loss", "grad_norm", "step_time_s", "memory_allocated", "memory_peak", "memory_host_rss")
METRIC_VAR = VariableSpec(
    "metric",
    "Band metric",
    values=BAND_METRICS,
    description="the per-step figure drawn against the baseline band",
)
SUMMARY_METRIC_VAR = VariableSpec(
    "summary_metric",
    "Summary metric",
    sql=(
        "SELECT DISTINCT arrayJoin(mapKeys(metrics)) AS metric FROM {db}.run_summaries FINAL\n"
        "WHERE if(baseline_key = '', '(none)', baseline_key) IN (${baseline_key:sqlstring}) ORDER BY metric"
    ),
    description="a run-summary figure drawn over the job's history",
)

# -- annotations ----------------------------------------------------------------------------------

ANOMALY_MARKS = AnnotationSpec(
    "Anomalies",
    "SELECT ts AS time, concat(severity, ' ', detector, ' at step ', toString(step), ': ', message) "
    "AS text,\n"
    "       [detector, severity] AS tags\n"
    f"FROM {{db}}.anomalies FINAL WHERE {RUN} AND $__timeFilter(ts) ORDER BY time",
    "red",
)
# One per action kind, in the kind's colour (the report's too:
# contract/runwatch/contract/action_kinds.py).
ACTION_MARKS = tuple(
    AnnotationSpec(
        f"Actions: {name}",
        "SELECT issued_at AS time, concat(kind, ' at step ', toString(step), ': ', reason) AS text, [kind] "
        "AS tags\n"
        f"FROM {{db}}.actions FINAL WHERE {RUN} AND kind = '{name}' AND $__timeFilter(issued_at) "
        "ORDER BY time",
        spec.color,
    )
    for name, spec in ACTION_KINDS.items()
)
ROLLBACK_MARKS = AnnotationSpec(
    "Rollbacks",
    "SELECT ts AS time,\n"
    "       concat('rollback ', JSONExtractString(payload, 'outcome'), ': step ', toString(step), ' -> ',\n"
    "              toString(JSONExtract(payload, 'to_step', 'Nullable(Int64)'))) AS text,\n"
    "       ['rollback', JSONExtractString(payload, 'outcome')] AS tags\n"
    f"FROM {{db}}.telemetry FINAL WHERE {RUN} AND kind = 'action_ack'\n"
    "  AND JSONExtractString(payload, 'action_kind') = 'rollback' AND $__timeFilter(ts) ORDER BY time",
    "purple",
)
