"""A run split by rank group (issue 36): which group a rank is in, and the Kafka key of its telemetry.

A run of more ranks than its group size is split: rank ``r`` is in group ``r // group_size``, and every
event of its ranks carries ``group_size`` and ``world_size`` and is keyed ``<run id>#<group>``, so the
groups of one run land on different partitions, hence different workers. A worker joins each group's
steps (stage one) and reports them, signed, to the worker that owns the run id's partition (stage two),
which merges them into the run's joined step. A run of at most one group is keyed by its run id, as
before the split existed (``#`` is not a run id character: the two key forms cannot meet).
"""

from __future__ import annotations

# Ranks per group: a run of at most this many ranks is not split. A group's state (its ranks' detectors,
# about 11 KB a rank at steady state) must snapshot in at most 1 MiB (issue 36): 64 ranks is about 0.75 MiB.
DEFAULT_GROUP_SIZE = 64
GROUP_SEPARATOR = "#"
MAX_GROUP_SIZE = 1 << 20


def group_of(rank: int, group_size: int) -> int:
    return rank // group_size


def groups_in(world_size: int, group_size: int) -> int:
    """How many groups a world of ``world_size`` ranks makes (the last may be smaller)."""
    return -(-world_size // group_size)


def group_ranks(group: int, group_size: int, world_size: int) -> range:
    """The ranks of ``group``."""
    return range(group * group_size, min((group + 1) * group_size, world_size))


def is_split(world_size: int, group_size: int) -> bool:
    return world_size > group_size


def group_key(run_id: str, group: int) -> str:
    """The key of a split run's group: its state key on the worker and its telemetry's Kafka key."""
    return f"{run_id}{GROUP_SEPARATOR}{group}"


def record_key(run_id: str, rank: int = 0, group_size: int | None = None) -> bytes:
    """The Kafka key of a rank's telemetry: ``<run id>#<group>`` in a split run (``group_size`` given),
    else the run id."""
    if group_size is None:
        return run_id.encode()
    return group_key(run_id, group_of(rank, group_size)).encode()


def parse_key(key: str) -> tuple[str, int | None]:
    """(run id, group) of a state or record key; group None for a run's own key."""
    run_id, separator, group = key.rpartition(GROUP_SEPARATOR)
    if not separator or not group.isdigit():
        return key, None
    return run_id, int(group)
