"""The Pipeline dashboard: the pipeline itself: throughput in and out, delays, findings per detector,
dead letters and duplicates."""

from __future__ import annotations

from runwatch.sinks.grafana.specs import DashboardSpec, PanelSpec

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
