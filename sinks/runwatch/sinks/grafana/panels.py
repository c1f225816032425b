"""The dashboards' contents as plain data: every panel's title, kind, SQL and expected columns, every
variable and annotation query. ``dashboards.py`` turns these into Grafana JSON with the SDK's
builders; the tests run every SQL here against ClickHouse; the HTML report can draw the same panels.

SQL conventions (the ClickHouse plugin's): the time column is aliased ``time``; time filters and
buckets use the plugin's macros (``$__timeFilter(ts)``, ``$__timeInterval(ts)``, ``$__interval_s``);
variables are written ``${name:sqlstring}`` (quoted and escaped by Grafana, whatever the plugin
version). ``{db}`` stands for the sink's database. Time-series panels return long frames (time, text
labels, numbers) ordered by time, which the plugin turns into one series per label value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from runwatch.contract.action_kinds import ACTION_KINDS, POLICY_KINDS
from runwatch.detectors.baselines.compare import METRICS, PREFIXED, BaselineConfig, MetricSpec
from runwatch.sinks.goodput import CATEGORIES as GOODPUT_CATEGORIES

PanelKind = Literal["timeseries", "table", "stat", "heatmap", "state_timeline", "bar_chart"]
TIME_SERIES_KINDS = frozenset({"timeseries", "heatmap", "state_timeline"})


@dataclass(frozen=True)
class PanelSpec:
    """One panel: what it shows (``description``), its SQL and the columns that SQL returns."""

    title: str
    kind: PanelKind
    sql: str
    columns: tuple[str, ...]
    description: str
    unit: str = ""
    width: int = 12
    height: int = 8
    log_scale: bool = False
    value_names: dict[int, str] = field(default_factory=dict)  # numeric codes shown as text (phases)
    cannot_show: str = ""  # what a reader might expect here that ClickHouse does not hold

    @property
    def format(self) -> int:
        """The plugin's query format: 0 time series, 1 table."""
        return 0 if self.kind in TIME_SERIES_KINDS else 1

    def render(self, db: str) -> str:
        return self.sql.replace("{db}", db)


@dataclass(frozen=True)
class VariableSpec:
    """A dashboard variable: a query over ClickHouse, or fixed ``values``."""

    name: str
    label: str
    sql: str = ""
    values: tuple[str, ...] = ()
    multi: bool = False
    include_all: bool = False
    description: str = ""

    def render(self, db: str) -> str:
        return self.sql.replace("{db}", db)


@dataclass(frozen=True)
class AnnotationSpec:
    """Marks on every time-series panel: SQL returning ``time``, ``text`` and ``tags``."""

    name: str
    sql: str
    color: str
    columns: tuple[str, ...] = ("time", "text", "tags")

    def render(self, db: str) -> str:
        return self.sql.replace("{db}", db)


@dataclass(frozen=True)
class DashboardSpec:
    uid: str
    title: str
    description: str
    time_from: str
    variables: tuple[VariableSpec, ...]
    sections: tuple[tuple[str, tuple[PanelSpec, ...]], ...]
    annotations: tuple[AnnotationSpec, ...] = ()
    refresh: str = "30s"

    @property
    def panels(self) -> tuple[PanelSpec, ...]:
        return tuple(p for _, panels in self.sections for p in panels)


# -- shared fragments ---------------------------------------------------------------------------

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


def _payload(path: str, kind: str = "Nullable(Float64)") -> str:
    keys = ", ".join(f"'{k}'" for k in path.split("."))
    return f"JSONExtract(payload, {keys}, '{kind}')"


def _step_panel(
    title: str, columns: dict[str, str], description: str, unit: str = "", **kw: Any
) -> PanelSpec:
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

# -- Fleet --------------------------------------------------------------------------------------------

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

# -- Run --------------------------------------------------------------------------------------------

RUN_FACTS = PanelSpec(
    "Run",
    "table",
    "SELECT run_id, JSONExtractString(payload, 'baseline_key') AS baseline_key,\n"
    "       JSONExtractString(payload, 'git_sha') AS git_sha, JSONExtractString(payload, 'host') AS host,\n"
    "       JSONExtract(payload, 'world_size', 'Int64') AS world_size,\n"
    "       JSONExtractString(payload, 'torch_version') AS torch_version, ts AS started_at\n"
    f"FROM {{db}}.telemetry FINAL WHERE {RUN} AND kind = 'run_start' ORDER BY ts DESC LIMIT 1",
    ("run_id", "baseline_key", "git_sha", "host", "world_size", "torch_version", "started_at"),
    "What the run said about itself at its start.",
    width=16,
    height=4,
)
RUN_PROGRESS = PanelSpec(
    "Progress",
    "stat",
    "SELECT maxIf(step, kind = 'step') AS last_step, countIf(kind = 'step' AND rank = 0) AS steps_executed,\n"
    "       argMaxIf(JSONExtractString(payload, 'status'), ts, kind = 'run_end') AS status\n"
    f"FROM {{db}}.telemetry FINAL WHERE {RUN}",
    ("last_step", "steps_executed", "status"),
    "Last step reached, steps executed by rank 0 (replays after rollbacks included) and the run_end status.",
    width=8,
    height=4,
)
RUN_LOSS = _step_panel("Loss", {"loss": "loss"}, "Training loss of each selected rank; NaN/inf show as gaps.")
RUN_LR = PanelSpec(
    "Learning rate",
    "timeseries",
    "SELECT ts AS time, concat('rank ', toString(rank), ' group ', toString(grp)) AS series, lr_value AS lr\n"
    "FROM {db}.telemetry FINAL\n"
    "ARRAY JOIN JSONExtract(payload, 'lr', 'Array(Float64)') AS lr_value,\n"
    "           arrayEnumerate(JSONExtract(payload, 'lr', 'Array(Float64)')) AS grp\n"
    f"WHERE {RUN} AND kind = 'step' AND {RANKS} AND $__timeFilter(ts)\nORDER BY time",
    ("time", "series", "lr"),
    "Each parameter group's learning rate (a rollback's LR scale shows here).",
)
RUN_GRAD = _step_panel(
    "Grad norm before / after clipping",
    {"grad_norm": "grad_norm", "grad_norm_clipped": _payload("grad_norm_clipped")},
    "Total gradient norm before clipping and after it.",
    log_scale=True,
)
RUN_CLIP = _step_panel(
    "Clip ratio", {"clip_ratio": _payload("clip_ratio")}, "Clipped norm over raw norm (1: no clipping)."
)
RUN_TOP_MODULES = PanelSpec(
    "Module grad norms (top 8)",
    "timeseries",
    "SELECT ts AS time, kv.1 AS module, concat('rank ', toString(rank)) AS series, kv.2 AS grad_norm\n"
    "FROM {db}.telemetry FINAL ARRAY JOIN JSONExtractKeysAndValues(payload, 'module_grad_norms', 'Float64') "
    "AS kv\n"
    f"WHERE {RUN} AND kind = 'step' AND {RANKS} AND $__timeFilter(ts) AND kv.1 IN (\n"
    "  SELECT m.1 AS name FROM {db}.telemetry FINAL\n"
    "  ARRAY JOIN JSONExtractKeysAndValues(payload, 'module_grad_norms', 'Float64') AS m\n"
    f"  WHERE {RUN} AND kind = 'step' AND {RANKS} AND $__timeFilter(ts) AND isFinite(m.2)\n"
    "  GROUP BY name ORDER BY max(m.2) DESC LIMIT 8)\n"
    "ORDER BY time",
    ("time", "module", "series", "grad_norm"),
    "The 8 modules with the largest gradient norm in the range, per step.",
    log_scale=True,
)
RUN_MODULE_HEATMAP = PanelSpec(
    "Module grad norms (heatmap, log10)",
    "heatmap",
    "SELECT $__timeInterval(ts) AS time, kv.1 AS module, log10(max(kv.2)) AS log10_grad_norm\n"
    "FROM {db}.telemetry FINAL ARRAY JOIN JSONExtractKeysAndValues(payload, 'module_grad_norms', 'Float64') "
    "AS kv\n"
    f"WHERE {RUN} AND kind = 'step' AND {RANKS} AND $__timeFilter(ts) AND isFinite(kv.2) AND kv.2 > 0\n"
    "GROUP BY time, module ORDER BY time",
    ("time", "module", "log10_grad_norm"),
    "Every module's gradient norm (largest over the selected ranks and the interval): one exploding "
    "module is one bright row.",
    width=24,
    height=10,
    cannot_show=(
        "Non-finite module norms are left out (log10 of NaN/inf); the Anomalies annotation marks them."
    ),
)
RUN_UPDATE = _step_panel(
    "Update ratio",
    {"relative_update_norm": _payload("relative_update_norm")},
    "Update norm over parameter norm (healthy: about 1e-4 to 1e-2); measured every few steps (update_every).",
    log_scale=True,
)
RUN_EFFECTIVE_LR = _step_panel(
    "Effective LR ratio",
    {"effective_lr_ratio": _payload("effective_lr_ratio")},
    "The optimizer's effective step over the nominal LR.",
)
RUN_STEP_TIME = _step_panel(
    "Step time",
    {"step_time_s": "step_time_s", "compute_s": _payload("compute_s")},
    "Wall time of each step and the rank's own compute part of it.",
    "s",
)
RUN_THROUGHPUT = _step_panel(
    "Throughput",
    {"samples_per_s": _payload("samples_per_s"), "tokens_per_s": _payload("tokens_per_s")},
    "Samples and tokens per second of each rank.",
)
RUN_MFU = _step_panel(
    "MFU",
    {"mfu": _payload("mfu")},
    "Model FLOPs utilisation (needs the model's FLOPs per step).",
    "percentunit",
)
RUN_DATA_WAIT = _step_panel(
    "Data wait", {"data_wait_s": _payload("data_wait_s")}, "Time each step waited for its batch.", "s"
)
RUN_MEMORY = _step_panel(
    "Memory",
    {
        "allocated": _payload("memory.allocated"),
        "reserved": _payload("memory.reserved"),
        "peak": _payload("memory.peak"),
        "host_rss": _payload("memory.host_rss"),
    },
    "CUDA memory allocated, reserved and peak, and the host process's RSS (a source that is not "
    "available, e.g. CUDA on a CPU run, is absent).",
    "bytes",
    width=24,
)
RUN_CATEGORY_LOSS = PanelSpec(
    "Per-category loss",
    "timeseries",
    "SELECT ts AS time, kv.1 AS category, concat('rank ', toString(rank)) AS series,\n"
    "       JSONExtract(kv.2, 'mean', 'Nullable(Float64)') AS mean_loss\n"
    "FROM {db}.telemetry FINAL ARRAY JOIN JSONExtractKeysAndValuesRaw(payload, 'category_loss') AS kv\n"
    f"WHERE {RUN} AND kind = 'step' AND {RANKS} AND $__timeFilter(ts)\nORDER BY time",
    ("time", "category", "series", "mean_loss"),
    "Mean loss per data category (one diverging while the mean looks fine).",
)
RUN_EVAL = PanelSpec(
    "Eval metrics",
    "timeseries",
    "SELECT ts AS time, JSONExtractString(payload, 'split') AS split, kv.1 AS metric, kv.2 AS value\n"
    "FROM {db}.telemetry FINAL\n"
    "ARRAY JOIN arrayConcat([('loss', JSONExtract(payload, 'loss', 'Float64'))],\n"
    "                       JSONExtractKeysAndValues(payload, 'metrics', 'Float64')) AS kv\n"
    f"WHERE {RUN} AND kind = 'eval' AND $__timeFilter(ts)\nORDER BY time",
    ("time", "split", "metric", "value"),
    "Evaluation loss and metrics per split.",
)
RUN_FINDINGS = PanelSpec(
    "Findings",
    "table",
    "SELECT ts AS time, step, rank, detector, metric, severity, value, threshold, message\n"
    f"FROM {{db}}.anomalies FINAL WHERE {RUN} AND $__timeFilter(ts) ORDER BY time",
    ("time", "step", "rank", "detector", "metric", "severity", "value", "threshold", "message"),
    "Every anomaly of the run.",
    width=24,
)
RUN_ACTIONS = PanelSpec(
    "Actions",
    "table",
    "SELECT issued_at AS time, kind, step, onset_step, target_step, reason\n"
    f"FROM {{db}}.actions FINAL WHERE {RUN} AND $__timeFilter(issued_at) ORDER BY time",
    ("time", "kind", "step", "onset_step", "target_step", "reason"),
    "Actions issued for the run (rollback target: the newest checkpoint before the onset).",
    width=24,
)

# Goodput (issue 39, sinks/runwatch/sinks/goodput.py): the run's wall time by where it went, from the
# goodput table the sink writes when it summarises the run.
RUN_GOODPUT = PanelSpec(
    "Goodput",
    "table",
    "SELECT category, seconds, 100 * seconds / wall_s AS share_pct FROM (\n"
    f"  SELECT [{', '.join(repr(c) for c in GOODPUT_CATEGORIES)}] AS categories,\n"
    f"         [{', '.join(f'{c}_s' for c in GOODPUT_CATEGORIES)}] AS values, wall_s\n"
    f"  FROM {{db}}.goodput FINAL WHERE {RUN}\n"
    ") ARRAY JOIN categories AS category, values AS seconds WHERE wall_s > 0",
    ("category", "seconds", "share_pct"),
    "Where the run's wall time went (docs/goodput.md): productive step time (goodput is its share), then "
    "the time lost to steps a rollback undid, stalls and hangs, checkpoint saves, data waits, restart gaps, "
    "startup, evals and the rest. Written when the sink summarises the run.",
    width=24,
    height=6,
)

RUN_DASHBOARD = DashboardSpec(
    "runwatch-run",
    "runwatch / Run",
    "One run step by step: optimisation health, runtime, memory, data, evaluation; anomalies, actions "
    "and rollbacks marked on every graph.",
    "now-7d",
    (BASELINE_KEY, RUN_VAR, RANK_VAR),
    (
        ("Run", (RUN_FACTS, RUN_PROGRESS)),
        (
            "Optimisation",
            (
                RUN_LOSS,
                RUN_LR,
                RUN_GRAD,
                RUN_CLIP,
                RUN_TOP_MODULES,
                RUN_UPDATE,
                RUN_MODULE_HEATMAP,
                RUN_EFFECTIVE_LR,
                RUN_CATEGORY_LOSS,
            ),
        ),
        ("Runtime", (RUN_STEP_TIME, RUN_THROUGHPUT, RUN_MFU, RUN_DATA_WAIT, RUN_MEMORY)),
        ("Evaluation", (RUN_EVAL,)),
        ("Findings and actions", (RUN_FINDINGS, RUN_ACTIONS)),
        ("Goodput", (RUN_GOODPUT,)),
    ),
    (ANOMALY_MARKS, *ACTION_MARKS, ROLLBACK_MARKS),
)

# -- Ranks ------------------------------------------------------------------------------------------

RANK_STEP_TIME = _step_panel(
    "Step time per rank",
    {"step_time_s": "step_time_s"},
    "Wall time of each rank's steps (equal under DDP: the slow rank makes everyone wait).",
    "s",
)
RANK_COMPUTE = _step_panel(
    "Compute time per rank",
    {"compute_s": _payload("compute_s")},
    "Each rank's own work per step, without waiting for its peers: the straggler stands out here.",
    "s",
)
RANK_GAP = PanelSpec(
    "Slowest vs fastest rank",
    "timeseries",
    "SELECT ts AS time, compute_max_s - compute_min_s AS compute_gap_s,\n"
    "       step_time_max_s - step_time_min_s AS step_time_gap_s\n"
    f"FROM {{db}}.joined_steps FINAL WHERE {RUN} AND $__timeFilter(ts) ORDER BY time",
    ("time", "compute_gap_s", "step_time_gap_s"),
    "The worker's cross-rank join: the spread between the slowest and the fastest rank per step.",
    "s",
)
RANK_SLOWEST = PanelSpec(
    "Slowest rank count",
    "table",
    "SELECT toString(compute_max_rank) AS slowest_rank, count() AS steps,\n"
    "       round(avg(compute_max_s - compute_min_s), 4) AS mean_gap_s\n"
    f"FROM {{db}}.joined_steps FINAL WHERE {RUN} AND compute_max_rank IS NOT NULL AND $__timeFilter(ts)\n"
    "GROUP BY slowest_rank ORDER BY steps DESC",
    ("slowest_rank", "steps", "mean_gap_s"),
    "How often each rank was the slowest to compute its step.",
    width=8,
)
RANK_STRAGGLER = PanelSpec(
    "Straggler scores",
    "timeseries",
    "SELECT ts AS time, concat('rank ', toString(assumeNotNull(rank))) AS series, score\n"
    f"FROM {{db}}.anomalies FINAL WHERE {RUN} AND detector = 'straggler' AND $__timeFilter(ts) ORDER BY time",
    ("time", "series", "score"),
    "The straggler detector's score for each rank it flagged.",
    width=16,
)
RANK_HEARTBEATS = PanelSpec(
    "Heartbeats",
    "timeseries",
    "SELECT $__timeInterval(ts) AS time, concat('rank ', toString(rank)) AS series, count() AS heartbeats\n"
    f"FROM {{db}}.telemetry WHERE {RUN} AND kind = 'heartbeat' AND {RANKS} AND $__timeFilter(ts)\n"
    "GROUP BY time, series ORDER BY time",
    ("time", "series", "heartbeats"),
    "Heartbeats per interval and rank: a dead rank's line drops to nothing.",
)
RANK_HEARTBEAT_STEP = PanelSpec(
    "Last step by heartbeat",
    "timeseries",
    "SELECT ts AS time, concat('rank ', toString(rank)) AS series, step\n"
    f"FROM {{db}}.telemetry FINAL WHERE {RUN} AND kind = 'heartbeat' AND step IS NOT NULL AND {RANKS}\n"
    "  AND $__timeFilter(ts) ORDER BY time",
    ("time", "series", "step"),
    "The last completed step each rank reported: a hung rank's line goes flat.",
)
RANK_PHASES = PanelSpec(
    "Phases",
    "state_timeline",
    f"SELECT ts AS time, concat('rank ', toString(rank)) AS series,\n"
    f"       indexOf({list(PHASES)}, JSONExtractString(payload, 'phase')) AS phase\n"
    f"FROM {{db}}.telemetry FINAL WHERE {RUN} AND kind = 'heartbeat' AND {RANKS} AND $__timeFilter(ts)\n"
    "ORDER BY time",
    ("time", "series", "phase"),
    "What each rank was doing by its heartbeats (train, eval, checkpoint, dataload, idle).",
    width=24,
    value_names={i + 1: p for i, p in enumerate(PHASES)},
)
RANK_HUNG = PanelSpec(
    "Hung and dead ranks",
    "table",
    "SELECT ts AS time, step, rank, detector, JSONExtractString(evidence, 'kind') "
    "AS kind, value, threshold,\n"
    "       severity, message\n"
    f"FROM {{db}}.anomalies FINAL WHERE {RUN} AND detector IN ('hung_rank', 'stall') AND $__timeFilter(ts)\n"
    "ORDER BY time",
    ("time", "step", "rank", "detector", "kind", "value", "threshold", "severity", "message"),
    "Stall and hung-rank findings: 'silent' (heartbeats stopped: dead), 'peers_waiting' (one rank hung "
    "while the others wait), with the time waited and its limit.",
    width=24,
)
# Heartbeats with NVML's figures (the producer's `gpu` extra): payload.gpu (wire GpuHealth)
GPU_ROWS = (
    f"FROM {{db}}.telemetry FINAL WHERE {RUN} AND kind = 'heartbeat' AND {RANKS}\n"
    "  AND JSONHas(payload, 'gpu') AND $__timeFilter(ts)"
)
RANK_GPU = PanelSpec(
    "GPU health per rank",
    "timeseries",
    f"SELECT ts AS time, {SERIES},\n"
    f"       {_payload('gpu.sm_clock_mhz')} AS sm_clock_mhz,\n"
    f"       {_payload('gpu.temperature_c')} AS temperature_c\n"
    f"{GPU_ROWS}\nORDER BY time",
    ("time", "series", "sm_clock_mhz", "temperature_c"),
    "Each rank's SM clock (MHz) and GPU temperature (°C) as NVML reported them with its heartbeats (at "
    "most one sample a second; needs nvidia-ml-py on the ranks, the `gpu` extra): a throttled rank's "
    "clock drops below its peers'.",
    cannot_show="figures of ranks without nvidia-ml-py or a GPU (their heartbeats carry none)",
)
RANK_GPU_THROTTLE = PanelSpec(
    "GPU throttle reasons",
    "table",
    "SELECT min(ts) AS time, rank, arrayStringConcat(JSONExtract(payload, 'gpu', 'throttle_reasons', "
    "'Array(String)'), ', ') AS reasons,\n"
    f"       min({_payload('gpu.sm_clock_mhz')}) AS min_sm_clock_mhz,\n"
    f"       max({_payload('gpu.sm_clock_max_mhz')}) AS sm_clock_max_mhz,\n"
    f"       max({_payload('gpu.temperature_c')}) AS max_temperature_c, count() AS heartbeats\n"
    f"{GPU_ROWS}\n"
    "  AND length(JSONExtract(payload, 'gpu', 'throttle_reasons', 'Array(String)')) > 0\n"
    "GROUP BY rank, reasons ORDER BY time",
    ("time", "rank", "reasons", "min_sm_clock_mhz", "sm_clock_max_mhz", "max_temperature_c", "heartbeats"),
    "Why NVML held each rank's clocks down (sw_power_cap, hw_slowdown, sw/hw_thermal_slowdown, "
    "hw_power_brake, ...): from when, the lowest SM clock and the hottest temperature meanwhile, over how "
    "many heartbeats.",
    width=24,
)
RANK_JOIN = PanelSpec(
    "Incomplete steps",
    "table",
    "SELECT ts AS time, generation, step, world_size, reported_count, missing_count, ranks_missing\n"
    f"FROM {{db}}.joined_steps FINAL WHERE {RUN} AND NOT complete AND $__timeFilter(ts) ORDER BY time",
    ("time", "generation", "step", "world_size", "reported_count", "missing_count", "ranks_missing"),
    "Steps the join timed out on: how many ranks reported and how many did not, and the lowest ids of "
    "those that did not (64 at most).",
    width=24,
)

RANKS_DASHBOARD = DashboardSpec(
    "runwatch-ranks",
    "runwatch / Ranks",
    "One multi-rank run rank by rank: step and compute time, "
    "stragglers, heartbeats, phases, hung and dead ranks, GPU clocks and throttling.",
    "now-24h",
    (BASELINE_KEY, RUN_VAR, RANK_VAR),
    (
        ("Time per rank", (RANK_STEP_TIME, RANK_COMPUTE, RANK_GAP, RANK_SLOWEST, RANK_STRAGGLER)),
        ("Liveness", (RANK_HEARTBEATS, RANK_HEARTBEAT_STEP, RANK_PHASES, RANK_HUNG, RANK_JOIN)),
        ("GPU health", (RANK_GPU, RANK_GPU_THROTTLE)),
    ),
    (ANOMALY_MARKS, *ACTION_MARKS),
)

# -- Baselines --------------------------------------------------------------------------------------

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

# -- Pipeline -----------------------------------------------------------------------------------------

PIPE_RATES = PanelSpec(
    "Events in and out per second",
    "timeseries",
    "SELECT time, stream, count() / $__interval_s AS events_per_s FROM (\n"
    "  SELECT $__timeInterval(ts) AS time, concat('in: ', kind) AS stream FROM {db}.telemetry\n"
    "  WHERE $__timeFilter(ts)\n"
    "  UNION ALL\n"
    "  SELECT $__timeInterval(ts) AS time, 'out: joined steps' AS stream FROM {db}.joined_steps "
    "WHERE $__timeFilter(ts)\n"
    "  UNION ALL\n"
    "  SELECT $__timeInterval(ts) AS time, 'out: anomalies' AS stream FROM {db}.anomalies "
    "WHERE $__timeFilter(ts)\n"
    "  UNION ALL\n"
    "  SELECT $__timeInterval(issued_at) AS time, 'out: actions' AS stream FROM {db}.actions\n"
    "  WHERE $__timeFilter(issued_at)\n"
    ") GROUP BY time, stream ORDER BY time",
    ("time", "stream", "events_per_s"),
    "Telemetry in (by kind) and what the workers produced (joined steps, anomalies, actions), per second "
    "of event time.",
    width=24,
    cannot_show="Rates are of stored rows: events the sink has not yet stored, or that were dead-lettered, "
    "are not in them.",
)
PIPE_DELAY = PanelSpec(
    "Sink delay",
    "timeseries",
    "SELECT $__timeInterval(ts) AS time,\n"
    "       quantile(0.5)(dateDiff('millisecond', ts, inserted_at) / 1000) AS p50_s,\n"
    "       quantile(0.95)(dateDiff('millisecond', ts, inserted_at) / 1000) AS p95_s\n"
    "FROM {db}.telemetry WHERE $__timeFilter(ts) GROUP BY time ORDER BY time",
    ("time", "p50_s", "p95_s"),
    "From an event's time to its row in ClickHouse.",
    "s",
    cannot_show="Consumer lag in messages is Kafka's (kafka-consumer-groups --describe, kcat); ClickHouse "
    "holds no offsets.",
)
PIPE_DETECTION = PanelSpec(
    "Detection delay",
    "timeseries",
    "SELECT $__timeInterval(ts) AS time, detector,\n"
    "       quantile(0.95)(dateDiff('millisecond', ts, assumeNotNull(detected_at)) / 1000) AS p95_s\n"
    "FROM {db}.anomalies FINAL WHERE detected_at IS NOT NULL AND $__timeFilter(ts) GROUP BY time, detector\n"
    "ORDER BY time",
    ("time", "detector", "p95_s"),
    "From a step's event time to the worker's finding about it, per detector.",
    "s",
)
PIPE_FINDINGS = PanelSpec(
    "Findings per detector",
    "timeseries",
    "SELECT $__timeInterval(ts) AS time, detector, count() AS findings\n"
    "FROM {db}.anomalies FINAL WHERE $__timeFilter(ts) GROUP BY time, detector ORDER BY time",
    ("time", "detector", "findings"),
    "What each detector found, per interval.",
    cannot_show="Detector cost (CPU time per event) is not stored in ClickHouse; the worker does not "
    "export it. `runwatch evaluate` and tests/benchmarks measure it offline.",
)
PIPE_DEADLETTERS = PanelSpec(
    "Dead letters by reason",
    "table",
    "SELECT stage, source_topic, substring(reason, 1, 120) AS reason, count() AS letters, max(ts) "
    "AS last_seen,\n"
    "       sum(size) AS bytes\n"
    "FROM {db}.deadletter FINAL WHERE $__timeFilter(ts)\n"
    "GROUP BY stage, source_topic, reason ORDER BY letters DESC",
    ("stage", "source_topic", "reason", "letters", "last_seen", "bytes"),
    "Refused messages grouped by stage and reason (first 120 characters).",
    width=24,
)
PIPE_DUPLICATES = PanelSpec(
    "Late and duplicate events",
    "timeseries",
    "SELECT $__timeInterval(ts) AS time, run_id, max(late_events) AS late_events,\n"
    "       max(duplicate_events) AS duplicate_events\n"
    "FROM {db}.joined_steps FINAL WHERE $__timeFilter(ts) GROUP BY time, run_id ORDER BY time",
    ("time", "run_id", "late_events", "duplicate_events"),
    "The worker's join counts of events that came after their step was joined, and of events delivered "
    "more than once (at-least-once delivery), per multi-rank run.",
)

PIPELINE = DashboardSpec(
    "runwatch-pipeline",
    "runwatch / Pipeline",
    "The pipeline itself: throughput in and out, delays, findings per detector, dead letters.",
    "now-6h",
    (),
    (
        ("Throughput", (PIPE_RATES, PIPE_DELAY, PIPE_DETECTION)),
        ("Detectors and refusals", (PIPE_FINDINGS, PIPE_DUPLICATES, PIPE_DEADLETTERS)),
    ),
)

DASHBOARDS: tuple[DashboardSpec, ...] = (FLEET, RUN_DASHBOARD, RANKS_DASHBOARD, BASELINES_DASHBOARD, PIPELINE)
