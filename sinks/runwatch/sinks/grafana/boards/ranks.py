"""The Ranks dashboard: one run's ranks against each other: step and compute times, stragglers, heartbeats,
phases, hung ranks, GPUs and the join."""

from __future__ import annotations

from runwatch.sinks.grafana.specs import DashboardSpec, PanelSpec
from runwatch.sinks.grafana.sql_fragments import (
    ACTION_MARKS,
    ANOMALY_MARKS,
    BASELINE_KEY,
    PHASES,
    RANK_VAR,
    RANKS,
    RUN,
    RUN_VAR,
    SERIES,
    payload,
    step_panel,
)

RANK_STEP_TIME = step_panel(
    "Step time per rank",
    {"step_time_s": "step_time_s"},
    "Wall time of each rank's steps (equal under DDP: the slow rank makes everyone wait).",
    "s",
)
RANK_COMPUTE = step_panel(
    "Compute time per rank",
    {"compute_s": payload("compute_s")},
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
    f"       {payload('gpu.sm_clock_mhz')} AS sm_clock_mhz,\n"
    f"       {payload('gpu.temperature_c')} AS temperature_c\n"
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
    f"       min({payload('gpu.sm_clock_mhz')}) AS min_sm_clock_mhz,\n"
    f"       max({payload('gpu.sm_clock_max_mhz')}) AS sm_clock_max_mhz,\n"
    f"       max({payload('gpu.temperature_c')}) AS max_temperature_c, count() AS heartbeats\n"
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
