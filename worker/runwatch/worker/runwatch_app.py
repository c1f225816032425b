"""The Faust application the worker runs on: runwatch's settings (raw bytes, the short fetch wait of
runwatch's transport, quick group joins) and the hooks the worker needs of it (app.py sets them)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import faust

from runwatch.contract import topics
from runwatch.worker import transport

log = logging.getLogger(__name__)


def faust_broker_url(bootstrap: str) -> str:
    # runwatch:// is Faust's Kafka transport with a short fetch wait
    # (worker/runwatch/worker/transport.py)
    return ";".join(f"{transport.SCHEME}://{hp.strip()}" for hp in bootstrap.split(",") if hp.strip())


class RunwatchApp(faust.App):
    """Faust's app with hooks run first thing when it stops, while its agents and timers still run
    (Faust waits for every read event's acknowledgement before its ``on_before_shutdown``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.before_stop: list[Callable[[], Awaitable[None]]] = []
        # Set by the worker: the telemetry records as fetched go to it, not to Faust's streams, and a revoke
        # waits until what it took is settled (transport.py)
        self.take_telemetry: Callable[[list[transport.Taken]], Awaitable[None]] | None = None
        self.telemetry_settled: Callable[[], bool] | None = None

    async def on_stop(self) -> None:
        for hook in self.before_stop:
            try:
                await hook()
            except Exception:  # stopping goes on; what was not acknowledged is read again
                log.exception("a stop hook failed")
        await super().on_stop()


def faust_app(bootstrap: str, app_id: str, web_port: int = 6066, data_dir: Path | None = None) -> RunwatchApp:
    """A Faust app with runwatch's settings (raw bytes, short fetch wait, quick group joins). ``data_dir``:
    Faust's own folder (default Faust's, ``<app_id>-data`` in the working directory)."""
    extra = {"datadir": str(data_dir)} if data_dir is not None else {}
    return RunwatchApp(
        app_id,
        **extra,
        broker=faust_broker_url(bootstrap),
        value_serializer="raw",
        key_serializer="raw",
        processing_guarantee="at_least_once",
        # Tansu (and small clusters) join groups in about half the session timeout;
        # Faust's 60 s default leaves a new worker idle for 30 s.
        broker_session_timeout=6.0,
        broker_heartbeat_interval=1.0,
        broker_commit_interval=1.0,
        consumer_auto_offset_reset="earliest",
        topic_allow_declare=False,  # topics are created by `runwatch broker` / ensure_topics
        topic_partitions=topics.DEFAULT_PARTITIONS,
        store="memory://",
        producer_max_request_size=topics.STATE_MAX_BYTES + (1 << 20),  # a run's snapshot is one record
        web_enabled=False,
        web_port=web_port,
    )
