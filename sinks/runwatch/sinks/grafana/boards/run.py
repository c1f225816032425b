"""The Run dashboard: one run's training figures, step by step, with its findings, actions and goodput."""

from __future__ import annotations

from runwatch.sinks.goodput import CATEGORIES as GOODPUT_CATEGORIES
from runwatch.sinks.grafana.specs import DashboardSpec, PanelSpec
from runwatch.sinks.grafana.sql_fragments import (
    ACTION_MARKS,
    ANOMALY_MARKS,
    BASELINE_KEY,
    RANK_VAR,
    RANKS,
    ROLLBACK_MARKS,
    RUN,
    RUN_VAR,
    payload,
    step_panel,
)

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
RUN_LOSS = step_panel("Loss", {"loss": "loss"}, "Training loss of each selected rank; NaN/inf show as gaps.")
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
RUN_GRAD = step_panel(
    "Grad norm before / after clipping",
    {"grad_norm": "grad_norm", "grad_norm_clipped": payload("grad_norm_clipped")},
    "Total gradient norm before clipping and after it.",
    log_scale=True,
)
RUN_CLIP = step_panel(
    "Clip ratio", {"clip_ratio": payload("clip_ratio")}, "Clipped norm over raw norm (1: no clipping)."
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
RUN_UPDATE = step_panel(
    "Update ratio",
    {"relative_update_norm": payload("relative_update_norm")},
    "Update norm over parameter norm (healthy: about 1e-4 to 1e-2); measured every few steps (update_every).",
    log_scale=True,
)
RUN_EFFECTIVE_LR = step_panel(
    "Effective LR ratio",
    {"effective_lr_ratio": payload("effective_lr_ratio")},
    "The optimizer's effective step over the nominal LR.",
)
RUN_STEP_TIME = step_panel(
    "Step time",
    {"step_time_s": "step_time_s", "compute_s": payload("compute_s")},
    "Wall time of each step and the rank's own compute part of it.",
    "s",
)
RUN_THROUGHPUT = step_panel(
    "Throughput",
    {"samples_per_s": payload("samples_per_s"), "tokens_per_s": payload("tokens_per_s")},
    "Samples and tokens per second of each rank.",
)
RUN_MFU = step_panel(
    "MFU",
    {"mfu": payload("mfu")},
    "Model FLOPs utilisation (needs the model's FLOPs per step).",
    "percentunit",
)
RUN_DATA_WAIT = step_panel(
    "Data wait", {"data_wait_s": payload("data_wait_s")}, "Time each step waited for its batch.", "s"
)
RUN_MEMORY = step_panel(
    "Memory",
    {
        "allocated": payload("memory.allocated"),
        "reserved": payload("memory.reserved"),
        "peak": payload("memory.peak"),
        "host_rss": payload("memory.host_rss"),
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
