"""The ClickHouse sink on Kafka (``SinkConsumer``, a ``Sink``: sinks/runwatch/sinks/base.py): its own
consumer group, batches by size and time.

Offsets are committed only after a batch is in ClickHouse, so a crash or a
ClickHouse outage re-delivers rather than loses; the tables deduplicate on ids.
Detection never waits on this loop: it is a separate group on the same topics.

A message whose row ClickHouse refuses (or that cannot be serialised) never holds up
the rest: the batch is split until it is found, the others are stored, and it goes to
``runwatch.deadletter`` (stage ``sink``, with the reason) and straight into the
deadletter table. Its offset is committed only once that dead letter is published.

Run summaries (``summaries.SummaryUpkeep``): once a batch holding ``run_end`` events is stored,
those runs are summarised into ``run_summaries``; every ``summary_interval_s`` the runs whose events
stopped ``died_after_s`` ago without one are summarised as ``died``. A failure there is logged and
retried at the next interval, never stopping the sink.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from runwatch.contract import topics
from runwatch.contract.inbox import ActionInbox
from runwatch.contract.schema import (
    DEFAULT_LIMITS,
    DeadLetter,
    JoinedStep,
    WireLimits,
    check_record_key,
    decode_action,
    decode_anomaly,
    decode_received,
    utc_now,
)
from runwatch.contract.signing import ActionPublicKeys
from runwatch.sinks.base import Partition, Record, Sink, first_offsets
from runwatch.sinks.clickhouse import ClickHouseSink
from runwatch.sinks.connection import ClickHouseUnavailable
from runwatch.sinks.loop import ConsumeLoop, make_consumer, retry_durably
from runwatch.sinks.rows import storable_time
from runwatch.sinks.summaries import SummaryUpkeep

log = logging.getLogger(__name__)

_UNVERIFIED = "action bad_signature"  # the start of the reason an unverified action is dead-lettered with

SINK_GROUP = topics.SINK_GROUP

# topic -> the table its messages are stored in
TOPIC_TABLES = {
    topics.TELEMETRY: "telemetry",
    topics.ANOMALIES: "anomalies",
    topics.ACTIONS: "actions",
    topics.DEADLETTER: "deadletter",
    topics.JOINED: "joined_steps",
}


@dataclass
class SinkStats:
    rows: Counter[str] = field(default_factory=Counter)  # rows stored, by table
    # messages that do not decode, by topic (the worker's to dead-letter)
    skipped: Counter[str] = field(default_factory=Counter)
    # messages refused by ClickHouse or unserialisable, by topic
    deadlettered: Counter[str] = field(default_factory=Counter)
    # of those, dead letters that could not be published: their offsets were not committed
    deadletter_errors: int = 0
    batches: int = 0
    # writes that failed because ClickHouse was unreachable or could store nothing (the batch was retried)
    write_errors: int = 0
    commit_errors: int = 0  # offset commits that failed (broker unreachable, rebalance); rows were stored
    last_empty_poll: float = 0.0  # monotonic time of the last poll that returned nothing


class SinkConsumer(Sink):
    """Stores every runwatch topic in ClickHouse; ``write_batch`` returns once a batch is stored and its
    dead letters published (see the module docstring)."""

    label = "runwatch sink"

    def __init__(
        self,
        sink: ClickHouseSink,
        bootstrap: str,
        *,
        group_id: str = SINK_GROUP,
        batch_size: int = 2000,
        batch_interval_s: float = 0.5,
        session_timeout_ms: int = 6000,
        commit_timeout_ms: int = 5000,
        deadletter_timeout_s: float = 10.0,
        deadletter_producer: Any = None,
        limits: WireLimits = DEFAULT_LIMITS,
        summarize: bool = True,
        died_after_s: float = 600.0,
        summary_interval_s: float = 30.0,
        summary_loss_every: int = 100,
        public_keys: ActionPublicKeys | None = None,
        partitions: int | None = None,
    ):
        """``deadletter_producer``: a kafka-python ``KafkaProducer`` for the sink's dead letters
        (default: one on ``bootstrap``, made by ``run``; one given here is not closed by it).
        ``limits``: the worker's (``limits:`` in its YAML), so that both accept the same telemetry.
        ``summarize``: write run summaries (see the module doc); ``died_after_s``: a run whose last
        event is older is summarised as ``died``; ``summary_interval_s``: how often to look for them;
        ``summary_loss_every``: the summaries' loss_at_step_N (the config's ``baseline.loss_every``).
        ``public_keys``: the workers' public keys; actions not signed by one of them (or dated in the future)
        are dead-lettered, not stored (None: stored unchecked; ``runwatch sink`` always gives them); a batch
        whose every action fails verification is logged as such (the keys are not the workers').
        ``partitions``: the telemetry topic's partition count; a record on another partition than its key's
        is not stored (the worker dead-letters it)."""
        super().__init__()
        self.partitions = partitions
        self.limits = limits
        self._actions = ActionInbox(public_keys, remember=False) if public_keys is not None else None
        self._public_key_ids = ", ".join(public_keys.key_ids) if public_keys is not None else ""
        self.sink = sink
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.batch_size = batch_size
        self.batch_interval_s = batch_interval_s
        self.session_timeout_ms = session_timeout_ms
        self.commit_timeout_ms = commit_timeout_ms
        self.deadletter_timeout_s = deadletter_timeout_s
        self.stats = SinkStats()
        self.positions: dict[tuple[str, int], int] = {}  # next offset after what is stored
        self._lock = threading.Lock()
        self._given_producer = deadletter_producer
        self._producer: Any = deadletter_producer
        self.summaries = (
            SummaryUpkeep(
                sink, died_after_s=died_after_s, interval_s=summary_interval_s, loss_every=summary_loss_every
            )
            if summarize
            else None
        )

    def stored_through(self, topic: str, partition: int) -> int:
        """Next offset of ``topic[partition]`` not yet stored (0 if none)."""
        with self._lock:
            return self.positions.get((topic, partition), 0)

    # -- one batch ---------------------------------------------------------------------------

    def _decode_batch(
        self, records: list[Any]
    ) -> tuple[dict[str, list[tuple[Any, Any]]], list[tuple[Any, str]]]:
        """(record, item) per table, ``item`` being what ``SinkWriter.store`` takes; and (record,
        reason) of each message refused before it reaches ClickHouse (it would not be stored as sent)."""
        batch: dict[str, list[tuple[Any, Any]]] = {table: [] for table in TOPIC_TABLES.values()}
        refused: list[tuple[Any, str]] = []
        now = utc_now()
        actions = unverified = 0
        for r in records:
            table = TOPIC_TABLES.get(r.topic)
            if table is None:
                continue
            try:
                item, problem = self._decode(r, now)
            except Exception:  # noqa: BLE001 - whatever was sent, it must not stop the sink
                # Malformed telemetry is the worker's to dead-letter; the sink just skips it.
                self.stats.skipped[r.topic] += 1
                continue
            if r.topic == topics.ACTIONS and self._actions is not None:
                actions += 1
                unverified += problem is not None and problem.startswith(_UNVERIFIED)
            if problem is not None:
                refused.append((r, problem))
            elif item is not None:
                batch[table].append((r, item))
        if actions and unverified == actions:
            # Not a forger's odd message: every action the workers sent is refused. Loud, not a quiet count.
            log.warning(
                "runwatch sink: %d of %d actions fail verification: is the public key the workers'? (%s, "
                "now %s; they are dead-lettered, not stored)",
                unverified,
                actions,
                topics.PUBLIC_KEYS_ENV,
                self._public_key_ids,
            )
        return batch, refused

    def _decode(self, r: Any, now: datetime) -> tuple[Any, str | None]:
        if r.topic == topics.TELEMETRY:
            # the same verdict as the worker's: same limits, same receive time
            timestamp_s = r.timestamp / 1000 if r.timestamp is not None else None
            event, _, _ = decode_received(r.value, timestamp_s, now, self.limits, r.key)
            check_record_key(r.key, r.partition, self.partitions)
            if event.kind == "group_report":
                return None, None  # the workers' own (a split run's group to its run): not a rank's telemetry
            return (event, r.value), storable_time("telemetry", event.ts, now)
        if r.topic == topics.ANOMALIES:
            return decode_anomaly(r.value), None
        if r.topic == topics.ACTIONS:
            action = decode_action(r.value)
            if self._actions is None:
                return action, None
            verdict = self._actions.judge(r.value)  # the listener's and the remediator's check
            if verdict.reason not in (None, "expired"):  # (an expired action is history, stored as it was)
                return (
                    action,
                    f"action {verdict.reason}: not stored "
                    "(runwatch.actions holds only what the workers sign)",
                )
            return action, None
        if r.topic == topics.DEADLETTER:
            return DeadLetter.model_validate_json(r.value), None
        joined = JoinedStep.model_validate_json(r.value)
        return joined, storable_time("joined_steps", joined.ts, now)

    def _write(self, batch: dict[str, list[tuple[Any, Any]]]) -> list[tuple[Any, str]]:
        """Store the batch; returns (record, reason) of each message that cannot be stored.
        Raises ``ClickHouseUnavailable`` when ClickHouse cannot be reached."""
        refused: list[tuple[Any, str]] = []
        for table, entries in batch.items():
            if not entries:
                continue
            result = self.sink.writer.store(table, [item for _, item in entries])
            self.stats.rows[table] += result.stored
            refused.extend((entries[i][0], reason) for i, reason in result.refused)
        return refused

    def _deadletters(self, refused: list[tuple[Any, str]]) -> list[tuple[Any, DeadLetter]]:
        letters = []
        for r, reason in refused:
            letter = DeadLetter.for_message(
                reason,
                r.value,
                source_topic=r.topic,
                partition=r.partition,
                offset=r.offset,
                key=r.key,
                stage="sink",
            )
            log.warning(
                "runwatch sink: %s[%d]@%d refused, dead-lettered: %s", r.topic, r.partition, r.offset, reason
            )
            letters.append((r, letter))
        if letters:
            # Visible in the table at once, whatever becomes of the topic copy (same id: idempotent).
            result = self.sink.writer.store("deadletter", [letter for _, letter in letters])
            for i, reason in result.refused:  # cannot happen with a well-formed DeadLetter; say so if it does
                log.error(
                    "runwatch sink: dead letter for %s[%d]@%d not stored in ClickHouse: %s",
                    letters[i][0].topic,
                    letters[i][0].partition,
                    letters[i][0].offset,
                    reason,
                )
        return letters

    def _publish(self, letters: list[tuple[Any, DeadLetter]]) -> dict[Partition, int]:
        """Publish the dead letters and wait for them; returns, per (topic, partition), the first
        offset whose dead letter could not be published (nothing is committed from there on)."""
        unpublished: list[Record] = []
        if not letters:
            return {}
        sent = []
        for r, letter in letters:
            try:
                if self._producer is None:
                    raise RuntimeError("no Kafka producer for dead letters")
                outcome: Any = self._producer.send(topics.DEADLETTER, key=r.key, value=letter.to_json())
            except Exception as exc:  # noqa: BLE001 - metadata timeout, buffer full, closed producer
                outcome = exc
            sent.append((r, outcome))
        if self._producer is not None:
            try:
                self._producer.flush(timeout=self.deadletter_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the futures below say which ones failed
                log.warning("runwatch sink: flushing dead letters failed (%r)", exc)
        for r, outcome in sent:
            if isinstance(outcome, Exception):
                error: Any = outcome
            elif not outcome.is_done:
                error = "not delivered in time"
            elif outcome.failed():
                error = outcome.exception
            else:
                self.stats.deadlettered[r.topic] += 1
                continue
            self.stats.deadletter_errors += 1
            log.error(
                "runwatch sink: dead letter for %s[%d]@%d could not be published (%s); "
                "not committing past it",
                r.topic,
                r.partition,
                r.offset,
                error,
            )
            unpublished.append(r)
        return first_offsets(unpublished)

    def write_batch(self, pending: Sequence[Record]) -> dict[Partition, int]:
        """Store ``pending`` and publish its dead letters; returns, per (topic, partition), the
        first offset whose dead letter could not be published (``ConsumeLoop`` rewinds it)."""
        batch, refused = self._decode_batch(list(pending))
        letters = retry_durably(
            lambda: self._deadletters(refused + self._write(batch)),
            stopping=self.stopping,
            errors=ClickHouseUnavailable,
            on_error=self._write_failed,
            give_up=lambda: self.stats.write_errors > 20,
        )
        failed = self._publish(letters)
        if self.summaries is not None:
            ended = {item[0].run_id for _, item in batch["telemetry"] if item[0].kind == "run_end"}
            if ended:
                self.summaries.ended(ended)
            self.summaries.tick()
        return failed

    def _write_failed(self, exc: BaseException, delay: float) -> None:
        # ClickHouse down, or unable to store anything: keep the batch, retry, never commit past it
        self.stats.write_errors += 1
        log.warning(
            "runwatch sink: ClickHouse cannot store the batch (%s); retrying in %.1fs, nothing "
            "dead-lettered or committed meanwhile",
            exc,
            delay,
        )

    def committed(self, upto: Mapping[Partition, int]) -> None:
        with self._lock:
            for key, offset in upto.items():
                if offset > self.positions.get(key, 0):
                    self.positions[key] = offset
        self.stats.batches += 1

    def commit_failed(self, exc: Exception) -> None:
        self.stats.commit_errors += 1

    def idle(self) -> None:
        self.stats.last_empty_poll = time.monotonic()
        if self.summaries is not None:
            self.summaries.tick()

    # -- the loop ------------------------------------------------------------------------------

    def _make_producer(self) -> Any:
        from kafka import KafkaProducer

        timeout_ms = int(self.deadletter_timeout_s * 1000)
        return KafkaProducer(
            bootstrap_servers=self.bootstrap,
            api_version=topics.KAFKA_API_VERSION,
            acks="all",
            linger_ms=0,
            max_block_ms=timeout_ms,
            request_timeout_ms=max(500, timeout_ms // 2),
            delivery_timeout_ms=timeout_ms,
            reconnect_backoff_max_ms=1000,
            client_id="runwatch-sink",
        )

    def run(self) -> None:
        """Consume until ``stopping`` is set; flushes the last batch before returning."""
        consumer = make_consumer(
            self.bootstrap,
            topics.ALL_TOPICS,
            group_id=self.group_id,
            session_timeout_ms=self.session_timeout_ms,
            client_id="runwatch-sink",
        )
        if self._given_producer is None:
            self._producer = self._make_producer()
        loop = ConsumeLoop(
            self,
            batch_size=self.batch_size,
            batch_interval_s=self.batch_interval_s,
            commit_timeout_ms=self.commit_timeout_ms,
        )
        try:
            loop.run(consumer)  # closes the consumer
        finally:
            if self._given_producer is None and self._producer is not None:
                try:
                    self._producer.close(timeout=5)
                except Exception as exc:  # noqa: BLE001 - closing must not hide why we stopped
                    log.warning("runwatch sink: closing the dead-letter producer failed (%r)", exc)
                self._producer = None
