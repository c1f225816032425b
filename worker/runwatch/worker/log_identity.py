"""Which telemetry log the worker's offsets belong to (issue 35, item 3; docs/state.md, "A recreated log").

An offset means something only in the log it was read from. A broker that lost its data (Tansu, the
embedded broker, keeps everything in memory) or a topic deleted and created again starts the log anew at
offset 0, while a worker that lived through it still holds the old log's positions. Faust drops every
record below the offset it last read, Tansu answers a fetch past a log's end with nothing (Kafka with
``OffsetOutOfRange``, which aiokafka resets but Faust still drops below its read offset), and a commit of
the old position lands on the new log: the new log's first records were never judged, by this worker or a
successor starting at that commit.

``LogWatch`` tells when a partition's log is not the one its positions came from:

- **the topic id changed**, where the broker reports one (Kafka 2.8+, Tansu): read with kafka-python's
  admin client (aiokafka's metadata has no topic ids), at every assignment, before every commit and every
  few seconds. A change means every partition of the topic is new;
- **the log ends below the position**: a fetch's high watermark below the offset the worker has read up to
  (or was sent to by a committed offset), for ``ENDS_BELOW_S``. (Tansu's fetch high watermark is exact,
  unlike its ListOffsets "latest": docs/embedded-broker.md; a Kafka leader whose high watermark lags for a
  moment is not taken for a new log.)

The worker then reads the partition again from its beginning and forgets the old log's positions
(log_guard.py), its detector process forgets the runs' offsets (``TelemetryProcessor.log_recreated``), and no
commit of an old position reaches the new log (``commit_offsets_allowed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from runwatch.contract import topics

log = logging.getLogger(__name__)

ENDS_BELOW_S = 2.0  # a log end below the position this long (not a lagging leader's moment): recreated
ID_EVERY_S = 5.0  # the topic id is read at least this often (and before every commit)
ID_TIMEOUT_S = 5.0

UNKNOWN = object()  # the topic id could not be read now (the broker did not answer)


class TopicIds:
    """The topic's id as the broker reports it now, with kafka-python's admin client (blocking: call it
    from a thread). None: the broker reports no id, or has no such topic."""

    def __init__(self, bootstrap: str, topic: str = topics.TELEMETRY, timeout_s: float = ID_TIMEOUT_S):
        self.bootstrap = bootstrap
        self.topic = topic
        self.timeout_s = timeout_s
        self._admin: Any = None

    def read(self) -> str | None:
        from kafka import KafkaAdminClient

        if self._admin is None:
            self._admin = KafkaAdminClient(
                bootstrap_servers=self.bootstrap,
                api_version=topics.KAFKA_API_VERSION,
                request_timeout_ms=int(self.timeout_s * 1000),
            )
        try:
            (described,) = self._admin.describe_topics([self.topic])
        except Exception:
            self.close()  # (a new client next time: this one may hold a broken connection)
            raise
        if described.get("error_code"):
            return None
        topic_id = described.get("topic_id")
        return None if topic_id in (None, "", "00000000-0000-0000-0000-000000000000") else str(topic_id)

    def close(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            try:
                admin.close()
            except Exception:  # closing a broken client: nothing to do
                log.debug("closing the admin client failed", exc_info=True)


@dataclass
class LogWatch:
    """What the worker knows of its telemetry log: the topic id its positions belong to, and since when
    each partition's log has ended below its position."""

    known_id: str | None = None  # the topic id the worker's positions belong to (None: not known yet / none)
    clock: Callable[[], float] = time.monotonic
    ends_below_s: float = ENDS_BELOW_S
    _below_since: dict[int, float] = field(default_factory=dict)

    def id_changed(self, current: object) -> bool:
        """Whether ``current`` (a topic id read now, None, or ``UNKNOWN``) says the topic was recreated
        since the worker's positions were read. The first id read is taken as the positions' own."""
        if current is UNKNOWN or current is None:
            return False
        if self.known_id is None:
            self.known_id = str(current)
            return False
        return current != self.known_id

    def ends_below(self, partition: int, high: int | None, position: int | None) -> bool:
        """Whether ``partition``'s log, ending at ``high`` (a fetch's high watermark), has ended below the
        worker's ``position`` for ``ends_below_s``."""
        if high is None or position is None or high >= position:
            self._below_since.pop(partition, None)
            return False
        since = self._below_since.setdefault(partition, self.clock())
        return self.clock() - since >= self.ends_below_s

    def recreated(self, partitions: set[int], current: object) -> None:
        """The worker starts ``partitions`` again from their beginning; ``current``: the topic id now."""
        for partition in partitions:
            self._below_since.pop(partition, None)
        if current is not UNKNOWN and current is not None:
            self.known_id = str(current)


def commit_offsets_allowed(
    offsets: Mapping[Any, int], high: Callable[[Any], int | None], id_changed: bool
) -> tuple[dict[Any, int], dict[Any, str]]:
    """Which of the telemetry ``offsets`` (TopicPartition -> offset) may be committed: none when the topic
    id changed since they were read, and none beyond its log's end (``high``: a partition's high watermark,
    None when unknown). Returns (allowed, refused with why)."""
    allowed: dict[Any, int] = {}
    refused: dict[Any, str] = {}
    for tp, offset in offsets.items():
        end = high(tp)
        if id_changed:
            refused[tp] = "the topic was recreated (a new topic id) since it was read"
        elif end is not None and offset > end:
            refused[tp] = f"beyond the log's end {end} (the log was recreated)"
        else:
            allowed[tp] = offset
    return allowed, refused
