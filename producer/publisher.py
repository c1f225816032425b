"""``RunWatch``: the object training code holds to publish telemetry.

Every publish is a non-blocking put on a bounded in-memory queue; a daemon thread
serialises and hands events to kafka-python. The training loop never waits on the
network and never sees an exception from it: what cannot be queued or sent is
dropped and counted in ``stats``.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from runwatch.producer import topics
from runwatch.producer.schema import (
    ActionAckEvent,
    CheckpointEvent,
    CheckpointRef,
    EvalEvent,
    EventBase,
    HeartbeatEvent,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
)

log = logging.getLogger(__name__)


@dataclass
class PublisherStats:
    queued: int = 0
    published: int = 0  # acknowledged by the broker
    dropped: int = 0  # queue full, send failed, or not delivered by close()
    drop_reasons: dict[str, int] = field(default_factory=dict)


class RunWatch:
    """Publishes one rank's telemetry for one run.

    Construction returns immediately whether or not a broker is reachable. Call
    :meth:`close` at the end of the run (it is also registered with ``atexit``).
    """

    def __init__(
        self,
        run_id: str,
        bootstrap: str | None = None,
        *,
        rank: int = 0,
        world_size: int = 1,
        queue_size: int = 10_000,
        max_block_ms: int = 100,
        linger_ms: int = 5,
        topic: str = topics.TELEMETRY,
        run_start: dict[str, Any] | None = None,
    ):
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self.bootstrap = bootstrap or topics.bootstrap_from_env("127.0.0.1:9092")
        self.topic = topic
        self.stats = PublisherStats()
        self.checkpoints: list[CheckpointRef] = []
        self._key = run_id.encode()
        self._queue: queue.Queue[EventBase] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._closed = False
        self._offsets: dict[int, int] = {}  # partition -> highest acknowledged offset
        self._failed_after_queue = 0  # queued events whose send failed (already counted as dropped)
        self._close_deadline = float("inf")
        self._final = False
        self._warned_invalid = False
        self._producer_config = dict(
            bootstrap_servers=self.bootstrap,
            api_version=topics.KAFKA_API_VERSION,
            max_block_ms=max_block_ms,
            linger_ms=linger_ms,
            acks=1,
            reconnect_backoff_max_ms=1000,
            client_id=f"runwatch-{run_id}-r{rank}",
        )
        self._thread = threading.Thread(target=self._drain, name="runwatch-publisher", daemon=True)
        self._thread.start()
        atexit.register(self.close, 2.0)
        if rank == 0:
            self.publish(RunStartEvent(run_id=run_id, rank=rank, world_size=world_size, **(run_start or {})))

    # -- what training code calls -------------------------------------------------

    def publish(self, event: EventBase) -> bool:
        """Queue one event; never blocks. Returns False if it was dropped."""
        if self._closed:
            self._count_drop("closed")
            return False
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._count_drop("queue_full")
            return False
        with self._lock:
            self.stats.queued += 1
        return True

    def _build_and_publish(self, model: type[EventBase], **fields: Any) -> bool:
        # A bad argument is the caller's bug, but it must not crash hours of training:
        # count it, warn once, carry on.
        try:
            event = model(run_id=self.run_id, rank=self.rank, **fields)
        except ValidationError as exc:
            self._count_drop("invalid")
            if not self._warned_invalid:
                self._warned_invalid = True
                log.warning("runwatch: dropped an invalid %s event (further ones are only counted): %s",
                            model.__name__, exc)
            return False
        return self.publish(event)

    def step(self, step: int, **fields: Any) -> bool:
        return self._build_and_publish(StepEvent, step=step, **fields)

    def eval(self, step: int, split: str = "val", loss: float | None = None, **fields: Any) -> bool:
        return self._build_and_publish(EvalEvent, step=step, split=split, loss=loss, **fields)

    def heartbeat(self, step: int | None, phase: str = "train", time_in_phase_s: float = 0.0) -> bool:
        return self._build_and_publish(HeartbeatEvent, step=step, phase=phase, time_in_phase_s=time_in_phase_s)

    def checkpoint(self, step: int, path: str, ok: bool = True) -> CheckpointRef:
        """Register a checkpoint already written at ``path`` and announce it to the worker.

        A rollback restores the newest registered checkpoint taken before the anomaly.
        """
        ref = CheckpointRef(step=step, uri=str(path))
        if ok:
            self.checkpoints.append(ref)
        self.publish(CheckpointEvent(run_id=self.run_id, rank=self.rank, step=step, uri=str(path), ok=ok))
        return ref

    def ack(self, **fields: Any) -> bool:
        return self._build_and_publish(ActionAckEvent, **fields)

    def close(self, timeout: float = 10.0, status: str = "completed", summary: dict | None = None) -> PublisherStats:
        """Publish ``run_end`` (rank 0), deliver what is queued within ``timeout``, stop.

        Every event offered is then either ``published`` or ``dropped``, never both.
        """
        if self._closed:
            return self.stats
        if self.rank == 0:
            self.publish(RunEndEvent(run_id=self.run_id, rank=self.rank, status=status, summary=summary or {}))
        self._closed = True
        self._close_deadline = time.monotonic() + timeout
        self._closing.set()
        self._thread.join(timeout + 5.0)
        with self._lock:
            self._final = True  # late callbacks from a stuck client must not change the books
            unaccounted = self.stats.queued - self.stats.published - self._failed_after_queue
        if unaccounted > 0:
            self._count_drop("undelivered_at_close", unaccounted)
        atexit.unregister(self.close)
        return self.stats

    def delivered_offsets(self) -> dict[int, int]:
        """Highest broker-acknowledged offset per partition of the telemetry topic."""
        with self._lock:
            return dict(self._offsets)

    # -- background thread ----------------------------------------------------------

    def _count_drop(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.stats.dropped += n
            self.stats.drop_reasons[reason] = self.stats.drop_reasons.get(reason, 0) + n

    def _on_sent(self, metadata: Any) -> None:
        with self._lock:
            if self._final:
                return
            self.stats.published += 1
            if metadata.offset > self._offsets.get(metadata.partition, -1):
                self._offsets[metadata.partition] = metadata.offset

    def _on_failed(self, exc: BaseException) -> None:
        log.debug("runwatch: send failed: %r", exc)
        with self._lock:
            if self._final:
                return
            self._failed_after_queue += 1
        self._count_drop("send_failed")

    def _make_producer(self) -> Any:
        from kafka import KafkaProducer

        return KafkaProducer(**self._producer_config)

    def _drain(self) -> None:
        try:
            producer = self._make_producer()
        except Exception as exc:  # bad bootstrap string and the like: count, never raise
            log.warning("runwatch: cannot create Kafka producer (%s); events will be dropped", exc)
            producer = None
        while True:
            if self._closing.is_set() and time.monotonic() >= self._close_deadline:
                break  # what is still queued is counted as undelivered by close()
            try:
                event = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._closing.is_set():
                    break
                continue
            if producer is None:
                self._on_failed(RuntimeError("no producer"))
                continue
            try:
                future = producer.send(self.topic, key=self._key, value=event.to_json())
                future.add_callback(self._on_sent)
                future.add_errback(self._on_failed)
            except Exception as exc:  # KafkaTimeoutError when no broker answers within max_block_ms
                self._on_failed(exc)
        if producer is not None:
            try:  # the loop only ends once close() has set the deadline
                producer.flush(timeout=max(0.1, self._close_deadline - time.monotonic()))
            except Exception as exc:
                log.debug("runwatch: flush failed: %r", exc)
            try:
                producer.close(timeout=1.0)
            except Exception:
                pass
