"""Topic names and defaults shared by every component (overridable by environment)."""

from __future__ import annotations

import os
from typing import overload

TELEMETRY = "runwatch.telemetry"
ANOMALIES = "runwatch.anomalies"
ACTIONS = "runwatch.actions"
DEADLETTER = "runwatch.deadletter"
JOINED = "runwatch.joined"  # per-step cross-rank joins, for ClickHouse/Grafana
ALL_TOPICS = (TELEMETRY, ANOMALIES, ACTIONS, DEADLETTER, JOINED)  # what the sink stores
# The workers' per-run state snapshots (worker/runwatch/worker/state/snapshot.py): compacted, keyed by
# run id, and partitioned as TELEMETRY is (a run's snapshot goes to the partition number its telemetry
# comes from).
STATE = "runwatch.state"
STATE_MAX_BYTES = 16 * 1024 * 1024  # a snapshot is one record: a large multi-rank run's can be megabytes
STATE_TOPIC_CONFIG = {"cleanup.policy": "compact", "max.message.bytes": str(STATE_MAX_BYTES)}
CREATED_TOPICS = (*ALL_TOPICS, STATE)  # what `runwatch broker` / ensure_topics create

DEFAULT_PARTITIONS = 4

# Every consumer group, in one place (docs/operations.md lists them). The action listener
# has none: each trainer rank assigns itself the actions topic's partitions.
DETECT_GROUP = "runwatch-detect"  # the detection workers' consumer group (Faust app id)
SINK_GROUP = "runwatch-sink"  # the ClickHouse sink
REMEDIATE_GROUP = "runwatch-remediate"  # the remediator
ALL_GROUPS = (DETECT_GROUP, SINK_GROUP, REMEDIATE_GROUP)

BOOTSTRAP_ENV = "RUNWATCH_BOOTSTRAP"
# Actions are signed by the workers with their private key and verified with its public key(s) by everyone
# else (contract/runwatch/contract/signing.py, docs/security.md).
SIGNING_KEY_ENV = "RUNWATCH_ACTION_SIGNING_KEY"  # the workers only: the PEM private key, or its file's path
PUBLIC_KEYS_ENV = "RUNWATCH_ACTION_PUBLIC_KEYS"  # trainers, sink, remediator: public keys, comma-separated
LEGACY_SECRET_ENV = "RUNWATCH_ACTION_SECRET"  # the old shared HMAC secret: read by nothing, named in errors
GROUP_SIZE_ENV = "RUNWATCH_GROUP_SIZE"  # ranks per group of a split run (RunWatch; contract/groups.py)
ATTEMPT_ENV = "RUNWATCH_ATTEMPT"  # this launch's attempt of the run, the same on every rank (RunWatch)

# Pinned so that constructors never probe the broker (kafka-python 3.x returns at
# once with an explicit api_version, even when nothing is listening).
KAFKA_API_VERSION = (2, 8)  # (kafka-python 3 knows versions by two numbers: a third is warned about)


@overload
def bootstrap_from_env(default: str) -> str: ...
@overload
def bootstrap_from_env(default: None = None) -> str | None: ...
def bootstrap_from_env(default: str | None = None) -> str | None:
    return os.environ.get(BOOTSTRAP_ENV, default)


def key_partition(key: bytes, partitions: int) -> int:
    """The partition a record keyed ``key`` belongs on among ``partitions``: murmur2 of the key, the
    Java client's and kafka-python's default partitioner (docs/publishing-without-python.md). A run's
    events are all on this one partition; the worker refuses a record found elsewhere.

    A split run's group key ``<run id>#<group>`` (contract/groups.py) is placed from its run's: the partition
    after the run id's by ``group`` (mod ``partitions``), so that a run's groups fill the partitions in
    turn, as evenly as they divide, rather than wherever their hashes fall. A client's default partitioner
    does not know this rule: a split run's records are sent to this partition explicitly
    (``group_partition``)."""
    from kafka.partitioner.default import murmur2  # (lazily: imports without Kafka)

    run_id, separator, group = key.rpartition(b"#")
    if separator and group.isdigit() and len(group) <= 9:
        return (int(murmur2(run_id) & 0x7FFFFFFF) + int(group)) % partitions
    return int(murmur2(key) & 0x7FFFFFFF) % partitions


def group_partition(key: bytes, partitions: int) -> int | None:
    """The partition to send a record keyed ``key`` to explicitly: ``key_partition`` for a split run's group
    key, None (the client's default partitioner, murmur2) for any other."""
    return key_partition(key, partitions) if b"#" in key else None
