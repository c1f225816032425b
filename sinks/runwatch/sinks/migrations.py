"""Versioned ClickHouse schema. Append a migration; never edit one that has shipped.

Every table deduplicates on its id (ReplacingMergeTree, read with FINAL), because
processing is at-least-once and a re-delivered batch must not double a row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "telemetry, anomalies, actions, deadletter",
        (
            """
            CREATE TABLE IF NOT EXISTS {db}.telemetry (
                event_id String,
                run_id LowCardinality(String),
                rank UInt32,
                kind LowCardinality(String),
                ts DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
                step Nullable(Int64),
                loss Nullable(Float64) CODEC(ZSTD(1)),
                grad_norm Nullable(Float64) CODEC(ZSTD(1)),
                step_time_s Nullable(Float64) CODEC(ZSTD(1)),
                payload String CODEC(ZSTD(3)),
                inserted_at DateTime64(3, 'UTC') DEFAULT now64(3)
            )
            ENGINE = ReplacingMergeTree(inserted_at)
            PARTITION BY toYYYYMM(ts)
            ORDER BY (run_id, event_id)
            TTL toDateTime(ts) + INTERVAL 90 DAY
            """,
            """
            CREATE TABLE IF NOT EXISTS {db}.anomalies (
                anomaly_id String,
                run_id LowCardinality(String),
                ts DateTime64(3, 'UTC'),
                step Nullable(Int64),
                rank Nullable(UInt32),
                detector LowCardinality(String),
                metric LowCardinality(String),
                value Nullable(Float64),
                threshold Nullable(Float64),
                score Nullable(Float64),
                severity LowCardinality(String),
                message String,
                evidence String CODEC(ZSTD(3)),
                inserted_at DateTime64(3, 'UTC') DEFAULT now64(3)
            )
            ENGINE = ReplacingMergeTree(inserted_at)
            ORDER BY (run_id, anomaly_id)
            """,
            """
            CREATE TABLE IF NOT EXISTS {db}.actions (
                action_id String,
                run_id LowCardinality(String),
                kind LowCardinality(String),
                reason String,
                anomaly_ids Array(String),
                step Nullable(Int64),
                onset_step Nullable(Int64),
                target_step Nullable(Int64),
                target_uri Nullable(String),
                params String,
                issued_at DateTime64(3, 'UTC'),
                expires_at DateTime64(3, 'UTC'),
                inserted_at DateTime64(3, 'UTC') DEFAULT now64(3)
            )
            ENGINE = ReplacingMergeTree(inserted_at)
            ORDER BY (run_id, action_id)
            """,
            """
            CREATE TABLE IF NOT EXISTS {db}.deadletter (
                id String,
                ts DateTime64(3, 'UTC'),
                source_topic LowCardinality(String),
                partition Nullable(Int32),
                offset Nullable(Int64),
                run_key Nullable(String),
                reason String,
                raw String CODEC(ZSTD(3)),
                inserted_at DateTime64(3, 'UTC') DEFAULT now64(3)
            )
            ENGINE = ReplacingMergeTree(inserted_at)
            ORDER BY id
            TTL toDateTime(ts) + INTERVAL 30 DAY
            """,
        ),
    ),
    Migration(
        2,
        "remediations",
        (
            # One row per command run or webhook post by `runwatch remediate`. Keyed by a per-execution
            # id, so a repeated execution of the same (action, target) would show as a second row.
            """
            CREATE TABLE IF NOT EXISTS {db}.remediations (
                execution_id String,
                action_id String,
                run_id LowCardinality(String),
                kind LowCardinality(String),
                target LowCardinality(String),
                target_key String,
                argv Array(String),
                url String,
                status LowCardinality(String),
                exit_code Nullable(Int32),
                output String CODEC(ZSTD(3)),
                started_at DateTime64(3, 'UTC'),
                finished_at DateTime64(3, 'UTC'),
                inserted_at DateTime64(3, 'UTC') DEFAULT now64(3)
            )
            ENGINE = ReplacingMergeTree(inserted_at)
            ORDER BY (run_id, action_id, target_key, execution_id)
            """,
        ),
    ),
    Migration(
        3,
        "joined_steps",
        (
            # One row per (run, generation, step): the worker's cross-rank join of a multi-rank run.
            """
            CREATE TABLE IF NOT EXISTS {db}.joined_steps (
                run_id LowCardinality(String),
                generation UInt32,
                step Int64,
                ts DateTime64(3, 'UTC') CODEC(Delta, ZSTD(1)),
                world_size UInt32,
                complete Bool,
                ranks_reported Array(UInt32),
                ranks_missing Array(UInt32),
                loss_mean Nullable(Float64),
                grad_norm Nullable(Float64),
                grad_sharded Bool,
                step_time_max_s Nullable(Float64),
                step_time_max_rank Nullable(UInt32),
                step_time_min_s Nullable(Float64),
                compute_max_s Nullable(Float64),
                compute_max_rank Nullable(UInt32),
                compute_min_s Nullable(Float64),
                memory_max_bytes Nullable(Int64),
                memory_max_rank Nullable(UInt32),
                memory_min_bytes Nullable(Int64),
                memory_min_rank Nullable(UInt32),
                samples_per_s Nullable(Float64),
                tokens_per_s Nullable(Float64),
                late_events UInt64,
                duplicate_events UInt64,
                inserted_at DateTime64(3, 'UTC') DEFAULT now64(3)
            )
            ENGINE = ReplacingMergeTree(inserted_at)
            PARTITION BY toYYYYMM(ts)
            ORDER BY (run_id, generation, step)
            TTL toDateTime(ts) + INTERVAL 90 DAY
            """,
        ),
    ),
    Migration(
        4,
        "deadletter: stage, size, sha256, raw_truncated, traceback",
        (
            # Bounded dead letters (issue 11): who refused the message (decode = the worker's validation,
            # detector = an error while handling a valid event, sink = a row ClickHouse refused), the size
            # and SHA-256 of the whole original value, whether `raw` holds only its first bytes, and the
            # traceback of a detector error. Rows written before this migration read as stage 'decode'.
            "ALTER TABLE {db}.deadletter ADD COLUMN IF NOT EXISTS stage LowCardinality(String) DEFAULT "
            "'decode' AFTER reason",
            "ALTER TABLE {db}.deadletter ADD COLUMN IF NOT EXISTS size UInt64 DEFAULT 0 AFTER stage",
            "ALTER TABLE {db}.deadletter ADD COLUMN IF NOT EXISTS sha256 Nullable(String) AFTER size",
            "ALTER TABLE {db}.deadletter ADD COLUMN IF NOT EXISTS raw_truncated Bool DEFAULT false AFTER raw",
            "ALTER TABLE {db}.deadletter ADD COLUMN IF NOT EXISTS traceback Nullable(String) CODEC(ZSTD(3)) "
            "AFTER raw_truncated",
        ),
    ),
    Migration(
        5,
        "anomalies: detected_at",
        (
            # When the worker produced the anomaly, by its own clock (issue 12); `ts` stays the event time
            # of the step it is about, so `detected_at - ts` is the detection latency. Null for rows
            # written before this migration and for anomalies no worker stamped (offline replay).
            "ALTER TABLE {db}.anomalies ADD COLUMN IF NOT EXISTS detected_at Nullable(DateTime64(3, 'UTC')) "
            "AFTER ts",
        ),
    ),
    Migration(
        6,
        "run_summaries",
        (
            # One row per run for comparing it with its job's history (issue 14): what it was (code,
            # hardware fingerprint, config, data) and its figures by name
            # (detectors/runwatch/detectors/baselines/summary.py). A missing figure is an absent key; a
            # non-finite one is stored as it is (Float64 holds NaN and inf), so the comparison can call it
            # INVALID. Rewritten rows (a run summarised again after more events arrived) replace the older by
            # `written_at`.
            """
            CREATE TABLE IF NOT EXISTS {db}.run_summaries (
                run_id String,
                baseline_key LowCardinality(String),
                git_sha String,
                git_dirty Nullable(Bool),
                commit_time Nullable(DateTime64(3, 'UTC')),
                fingerprint LowCardinality(String),
                fingerprint_parts Map(String, String),
                config_hash String,
                dataset_version String,
                new_baseline Bool DEFAULT false,
                started_at DateTime64(3, 'UTC'),
                ended_at Nullable(DateTime64(3, 'UTC')),
                status LowCardinality(String),
                metrics Map(LowCardinality(String), Float64),
                written_at DateTime64(3, 'UTC') DEFAULT now64(3)
            )
            ENGINE = ReplacingMergeTree(written_at)
            ORDER BY run_id
            """,
        ),
    ),
    Migration(
        7,
        "anomalies: onset_step",
        (
            # Where the detector estimates the fault began (issue 27), beside `step`, where it was found.
            # Null where it estimates none and for rows written before this migration.
            "ALTER TABLE {db}.anomalies ADD COLUMN IF NOT EXISTS onset_step Nullable(Int64) AFTER step",
        ),
    ),
    Migration(
        8,
        "joined_steps: reported_count, missing_count",
        (
            # A joined step lists its ranks by id only while they are few (issue 36); the counts are whole.
            # Rows written before this migration: their lists' lengths.
            "ALTER TABLE {db}.joined_steps ADD COLUMN IF NOT EXISTS reported_count UInt32 "
            "DEFAULT length(ranks_reported) AFTER ranks_missing",
            "ALTER TABLE {db}.joined_steps ADD COLUMN IF NOT EXISTS missing_count UInt32 "
            "DEFAULT length(ranks_missing) AFTER reported_count",
        ),
    ),
    Migration(
        9,
        "goodput",
        (
            # One row per run (issue 39, sinks/runwatch/sinks/goodput.py, docs/goodput.md): its wall time and
            # where it went, in seconds; the categories partition the wall time. Rewritten when the run is
            # summarised again (the newest row by `computed_at` stands).
            """
            CREATE TABLE IF NOT EXISTS {db}.goodput (
                run_id String,
                attempts UInt32,
                steps UInt64,
                steps_lost UInt64,
                started_at DateTime64(3, 'UTC'),
                ended_at DateTime64(3, 'UTC'),
                wall_s Float64,
                productive_s Float64,
                rollback_lost_s Float64,
                stall_s Float64,
                checkpoint_s Float64,
                data_wait_s Float64,
                restart_gap_s Float64,
                startup_s Float64,
                eval_s Float64,
                other_s Float64,
                goodput Nullable(Float64),
                computed_at DateTime64(3, 'UTC') DEFAULT now64(3)
            )
            ENGINE = ReplacingMergeTree(computed_at)
            ORDER BY run_id
            """,
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version
