"""The Faust application: consumes telemetry as raw bytes, runs the processor, publishes.

Built by ``create_app`` (not at import time) so that the bootstrap, config and secret
come from the command line. ``run_worker`` starts it in this process.
"""

from __future__ import annotations

import logging
from pathlib import Path

import faust

from runwatch.detectors import RunwatchConfig
from runwatch.producer import topics
from runwatch.streams import transport
from runwatch.streams.processor import ProcessResult, TelemetryProcessor

log = logging.getLogger("runwatch.worker")

DETECT_GROUP = topics.DETECT_GROUP
TICK_INTERVAL_S = 0.25  # as `runwatch replay --tick` does on event time


def faust_broker_url(bootstrap: str) -> str:
    # runwatch:// is Faust's Kafka transport with a short fetch wait (streams/transport.py)
    return ";".join(f"{transport.SCHEME}://{hp.strip()}" for hp in bootstrap.split(",") if hp.strip())


def faust_app(bootstrap: str, app_id: str, web_port: int = 6066) -> faust.App:
    """A Faust app with runwatch's settings (raw bytes, short fetch wait, quick group joins)."""
    return faust.App(
        app_id,
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
        web_enabled=False,
        web_port=web_port,
    )


def mark_ready_on_assignment(app: faust.App, ready_file: Path) -> None:
    """Write the assigned partitions to ``ready_file`` once the group has given us some."""

    @app.on_partitions_assigned.connect
    async def mark_ready(sender, assigned, **kwargs) -> None:  # noqa: ANN001
        ready_file.write_text(",".join(sorted(f"{tp.topic}:{tp.partition}" for tp in assigned)))


def create_app(
    bootstrap: str,
    config: RunwatchConfig,
    secret: bytes,
    *,
    app_id: str = DETECT_GROUP,
    web_port: int = 6066,
    ready_file: Path | None = None,
) -> tuple[faust.App, TelemetryProcessor]:
    app = faust_app(bootstrap, app_id, web_port)
    telemetry = app.topic(topics.TELEMETRY, value_serializer="raw", key_serializer="raw")
    anomalies = app.topic(topics.ANOMALIES, value_serializer="raw", key_serializer="raw")
    actions = app.topic(topics.ACTIONS, value_serializer="raw", key_serializer="raw")
    deadletter = app.topic(topics.DEADLETTER, value_serializer="raw", key_serializer="raw")
    joined = app.topic(topics.JOINED, value_serializer="raw", key_serializer="raw")
    processor = TelemetryProcessor(config, secret)

    async def publish(result: ProcessResult) -> None:
        for anomaly in result.anomalies:
            await anomalies.send(key=anomaly.run_id.encode(), value=anomaly.to_json())
        for action in result.actions:
            await actions.send(key=action.run_id.encode(), value=action.to_json())
        for step in result.joined:
            await joined.send(key=step.run_id.encode(), value=step.to_json())

    @app.agent(telemetry)
    async def detect(stream):  # noqa: ANN001 - Faust's stream type
        async for event in stream.events():
            msg = event.message
            result = processor.process(event.value, event.key, msg.partition, msg.offset)
            if result.deadletter is not None:
                log.warning("dead letter at %s[%s]@%s: %s", msg.topic, msg.partition, msg.offset,
                            result.deadletter.reason)
                await deadletter.send(key=event.key, value=result.deadletter.to_json())
            if result.anomalies or result.actions or result.joined:  # most events produce nothing
                await publish(result)

    @app.on_partitions_assigned.connect
    async def keep_owned_runs(sender, assigned, **kwargs) -> None:  # noqa: ANN001
        owned = {tp.partition for tp in assigned if tp.topic == topics.TELEMETRY}
        for run in processor.keep_partitions(owned):
            log.info("run %s moved to another worker", run)

    @app.timer(TICK_INTERVAL_S)
    async def tick() -> None:
        # Stalled or silent ranks are found by time passing, not by an event arriving.
        await publish(processor.tick())

    @app.timer(30.0)
    async def report_counters() -> None:
        c = processor.counters
        log.info("processed=%d deadlettered=%d anomalies=%d actions=%s runs=%d",
                 c.processed, c.deadlettered, c.anomalies, dict(c.actions), len(processor.monitors))

    if ready_file is not None:
        mark_ready_on_assignment(app, ready_file)

    return app, processor


def run_worker(app: faust.App, loglevel: str = "WARNING") -> None:
    """Run until SIGINT/SIGTERM (blocks; Faust installs the signal handlers)."""
    from faust.worker import Worker

    logging.getLogger("runwatch").setLevel(logging.INFO)
    Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
