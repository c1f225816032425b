"""Startup calls with a deadline that holds even when the client library blocks: the call runs in a
daemon thread that is abandoned at the deadline, so a worker, sink or remediator pointed at a broker or
database that is not there exits with one line instead of hanging (kafka-python's metadata calls and
clickhouse-connect's connect retry on their own, for minutes or forever)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

T = TypeVar("T")

CONNECT_TIMEOUT_S = 20.0  # each startup dependency (the broker, ClickHouse) must answer within this


class Unreachable(RuntimeError):
    """A startup call did not complete in time, or failed; the message is one line."""


def call_within(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()``, or ``Unreachable`` naming ``what`` if it raises or has not returned after ``timeout_s``."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller as one line
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"runwatch-reach-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Unreachable(f"cannot reach {what}: no answer within {timeout_s:g} s")
    if "error" in outcome:
        exc = outcome["error"]
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise Unreachable(f"cannot reach {what}: {type(exc).__name__}" + (f": {first}" if first else ""))
    return cast(T, outcome["value"])


def kafka_partition_counts(
    bootstrap: str, names: Iterable[str], timeout_s: float = CONNECT_TIMEOUT_S, metadata_wait_s: float = 3.0
) -> dict[str, int | None]:
    """How many partitions each topic of ``names`` has on the broker at ``bootstrap`` (None: it does not
    exist); ``Unreachable`` if the broker does not answer within ``timeout_s``."""
    from runwatch.contract import topics

    def probe() -> dict[str, int | None]:
        from kafka import KafkaConsumer

        consumer = KafkaConsumer(
            bootstrap_servers=bootstrap,
            api_version=topics.KAFKA_API_VERSION,
            group_id=None,
            enable_auto_commit=False,
            request_timeout_ms=int(timeout_s * 1000) + 1000,
        )
        try:
            counts: dict[str, int | None] = {}
            for name in names:
                found = consumer.partitions_for_topic(name)  # blocks until the broker answers
                until = time.monotonic() + metadata_wait_s
                while not found and time.monotonic() < until:  # metadata may name the topic a moment later
                    time.sleep(0.25)
                    found = consumer.partitions_for_topic(name)
                counts[name] = len(found) if found else None
            return counts
        finally:
            consumer.close()

    return call_within(probe, timeout_s, f"the Kafka broker at {bootstrap}")
