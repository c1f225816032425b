"""Topic names and defaults shared by every component (overridable by environment)."""

from __future__ import annotations

import os

TELEMETRY = "runwatch.telemetry"
ANOMALIES = "runwatch.anomalies"
ACTIONS = "runwatch.actions"
DEADLETTER = "runwatch.deadletter"
JOINED = "runwatch.joined"  # per-step cross-rank joins, for ClickHouse/Grafana
ALL_TOPICS = (TELEMETRY, ANOMALIES, ACTIONS, DEADLETTER, JOINED)

DEFAULT_PARTITIONS = 4

# Every consumer group, in one place (docs/operations.md lists them). The action listener
# has none: each trainer rank assigns itself the actions topic's partitions.
DETECT_GROUP = "runwatch-detect"  # the detection workers' consumer group (Faust app id)
SINK_GROUP = "runwatch-sink"  # the ClickHouse sink
REMEDIATE_GROUP = "runwatch-remediate"  # the remediator
ALL_GROUPS = (DETECT_GROUP, SINK_GROUP, REMEDIATE_GROUP)

BOOTSTRAP_ENV = "RUNWATCH_BOOTSTRAP"
SECRET_ENV = "RUNWATCH_ACTION_SECRET"

# Pinned so that constructors never probe the broker (kafka-python 3.x returns at
# once with an explicit api_version, even when nothing is listening).
KAFKA_API_VERSION = (2, 8, 0)


def bootstrap_from_env(default: str | None = None) -> str | None:
    return os.environ.get(BOOTSTRAP_ENV, default)
