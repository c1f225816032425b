"""The Fleet dashboard: every run at a glance, the findings and actions across them, the pipeline's health."""

from __future__ import annotations

from runwatch.contract.action_kinds import ACTION_KINDS, POLICY_KINDS
from runwatch.sinks.grafana.specs import DashboardSpec, PanelSpec
from runwatch.sinks.grafana.sql_fragments import (
    BASELINE_KEY,
    RUNS_OF_KEY,
)

FLEET_RUNS = PanelSpec(
    "Runs",
    "table",
    "SELECT t.run_id AS run_id, s.baseline_key AS baseline_key,\n"
    "       multiIf(e.status != '', e.status, "
    "t.last_event >= now64(3) - INTERVAL 120 SECOND, 'running', 'silent')\n"
    "         AS status,\n"
    "       t.ranks AS ranks, t.last_step AS last_step, round(t.steps_per_s, 3) AS steps_per_s,\n"
    "       t.last_event AS last_event, a.anomalies AS anomalies, a.critical AS critical,\n"
    "       x.actions AS actions, x.rollbacks AS rollbacks\n"
    "FROM (\n"
    "  SELECT run_id, uniqExact(rank) AS ranks, max(step) AS last_step, max(ts) AS last_event,\n"
    "         (maxIf(step, kind = 'step' AND rank = 0) - minIf(step, kind = 'step' AND rank = 0))\n"
    "           / greatest(dateDiff('millisecond', minIf(ts, kind = 'step' AND rank = 0),\n"
    "                               maxIf(ts, kind = 'step' AND rank = 0)) / 1000, 0.001) AS steps_per_s\n"
    f"  FROM {{db}}.telemetry WHERE $__timeFilter(ts) AND {RUNS_OF_KEY} GROUP BY run_id\n"
    ") AS t\n"
    "LEFT JOIN (SELECT run_id, argMax(JSONExtractString(payload, 'baseline_key'), ts) AS baseline_key\n"
    "           FROM {db}.telemetry WHERE kind = 'run_start' GROUP BY run_id) AS s ON s.run_id = t.run_id\n"
    "LEFT JOIN (SELECT run_id, argMax(JSONExtractString(payload, 'status'), ts) AS status\n"
    "           FROM {db}.telemetry WHERE kind = 'run_end' GROUP BY run_id) AS e ON e.run_id = t.run_id\n"
    "LEFT JOIN (SELECT run_id, count() AS anomalies, countIf(severity = 'critical') AS critical\n"
    "           FROM {db}.anomalies FINAL GROUP BY run_id) AS a ON a.run_id = t.run_id\n"
    "LEFT JOIN (SELECT run_id, count() AS actions, countIf(kind = 'rollback') AS rollbacks\n"
    "           FROM {db}.actions FINAL GROUP BY run_id) AS x ON x.run_id = t.run_id\n"
    "ORDER BY t.last_event DESC",
    (
        "run_id",
        "baseline_key",
        "status",
        "ranks",
        "last_step",
        "steps_per_s",
        "last_event",
        "anomalies",
        "critical",
        "actions",
        "rollbacks",
    ),
    "Every run with telemetry in the range: its run_end status, or 'running' (an event in the last 2 "
    "minutes) / 'silent' (none since: stalled or died without a run_end), ranks, last step, mean "
    "step rate of rank 0, anomalies (critical ones) and actions (rollbacks).",
    width=24,
    height=9,
)
FLEET_LIVE = PanelSpec(
    "Live runs",
    "stat",
    "SELECT countIf(last_event >= now64(3) - INTERVAL 120 SECOND) AS live_runs, count() AS runs_in_range\n"
    "FROM (SELECT run_id, max(ts) AS last_event FROM {db}.telemetry WHERE $__timeFilter(ts) "
    f"AND {RUNS_OF_KEY}\n"
    "      GROUP BY run_id)",
    ("live_runs", "runs_in_range"),
    "Runs with an event in the last 2 minutes, and all runs with telemetry in the range.",
    width=6,
    height=5,
)
FLEET_STEP_RATE = PanelSpec(
    "Step rate",
    "timeseries",
    "SELECT $__timeInterval(ts) AS time, run_id, count() / $__interval_s AS steps_per_s\n"
    f"FROM {{db}}.telemetry WHERE kind = 'step' AND rank = 0 AND $__timeFilter(ts) AND {RUNS_OF_KEY}\n"
    "GROUP BY time, run_id ORDER BY time",
    ("time", "run_id", "steps_per_s"),
    "Steps per second of each run (rank 0's step events "
    "per interval; replayed steps after a rollback count).",
    "ops",
    width=18,
    height=5,
)
FLEET_ANOMALIES = PanelSpec(
    "Anomalies per run",
    "timeseries",
    "SELECT $__timeInterval(ts) AS time, run_id, count() AS anomalies\n"
    f"FROM {{db}}.anomalies FINAL WHERE $__timeFilter(ts) AND {RUNS_OF_KEY}\nGROUP BY time, run_id "
    "ORDER BY time",
    ("time", "run_id", "anomalies"),
    "Findings per interval and run, by the time of the step they are about.",
)
# The action kinds by how drastic they are (contract/runwatch/contract/action_kinds.py), for
# ClickHouse's transform().
_KIND_ORDER = (
    f"transform(kind, [{', '.join(repr(k) for k in ACTION_KINDS)}], "
    f"[{', '.join(str(s.order) for s in ACTION_KINDS.values())}], 0)"
)
FLEET_ACTIONS = PanelSpec(
    "Actions per run",
    "table",
    "SELECT run_id, kind, count() AS actions, max(issued_at) AS last_issued\n"
    f"FROM {{db}}.actions FINAL WHERE $__timeFilter(issued_at) AND {RUNS_OF_KEY}\n"
    f"GROUP BY run_id, kind ORDER BY {_KIND_ORDER} DESC, last_issued DESC",
    ("run_id", "kind", "actions", "last_issued"),
    f"Actions the workers issued ({', '.join(POLICY_KINDS)}) per run, the most drastic kinds first.",
)
FLEET_DEADLETTERS = PanelSpec(
    "Dead letters",
    "timeseries",
    "SELECT $__timeInterval(ts) AS time, stage, count() AS dead_letters\n"
    "FROM {db}.deadletter FINAL WHERE $__timeFilter(ts) GROUP BY time, stage ORDER BY time",
    ("time", "stage", "dead_letters"),
    "Messages refused, by who refused them (decode: the worker's validation; detector: an error while "
    "handling a valid event; sink: a row ClickHouse refused). Dead letters are kept 30 days.",
)
FLEET_LAG = PanelSpec(
    "Worker and sink delay",
    "timeseries",
    "SELECT time, series, delay_s FROM (\n"
    "  SELECT $__timeInterval(ts) AS time, 'worker: detection p95' AS series,\n"
    "         quantile(0.95)(dateDiff('millisecond', ts, assumeNotNull(detected_at)) / 1000) AS delay_s\n"
    "  FROM {db}.anomalies FINAL WHERE detected_at IS NOT NULL AND $__timeFilter(ts) GROUP BY time\n"
    "  UNION ALL\n"
    "  SELECT $__timeInterval(ts) AS time, 'sink: stored p95' AS series,\n"
    "         quantile(0.95)(dateDiff('millisecond', ts, inserted_at) / 1000) AS delay_s\n"
    "  FROM {db}.telemetry WHERE $__timeFilter(ts) GROUP BY time\n"
    ") ORDER BY time",
    ("time", "series", "delay_s"),
    "How far behind the event time the worker found anomalies (detected_at - ts) and the sink stored "
    "telemetry (inserted_at - ts), 95th percentile per interval.",
    "s",
    width=24,
    cannot_show="Consumer lag in messages (the committed offset behind the log end) is Kafka's, not "
    "ClickHouse's: read it with `kafka-consumer-groups --describe --group runwatch-detect` or "
    "kcat. These delays are what ClickHouse can show of it.",
)

FLEET = DashboardSpec(
    "runwatch-fleet",
    "runwatch / Fleet",
    "Every run in the time range: status, progress, findings, actions, dead letters and pipeline delay.",
    "now-24h",
    (BASELINE_KEY,),
    (
        ("Runs", (FLEET_LIVE, FLEET_STEP_RATE, FLEET_RUNS)),
        ("Findings and actions", (FLEET_ANOMALIES, FLEET_ACTIONS)),
        ("Pipeline health", (FLEET_DEADLETTERS, FLEET_LAG)),
    ),
)
