"""The worker's detectors run in a child process. If that child dies, the worker must exit non-zero
(so that its supervisor restarts it) without having committed the events the child never answered:
the next worker reads them again, and the run's rollback is still issued. Nothing is lost."""

from __future__ import annotations

import math
import os
import signal
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kafka import KafkaProducer

from runwatch.producer import topics
from runwatch.producer.schema import CheckpointEvent, StepEvent, decode_action
from runwatch.streams.broker import EmbeddedBroker, committed_offset, ensure_topics
from runwatch.streams.demo import WorkerProcess

from .conftest import eventually, read_topic

pytestmark = pytest.mark.integration


def _detector_pid(worker: WorkerProcess) -> int:
    """The worker's detector process: its child that is not multiprocessing's resource tracker."""
    pid = worker.process.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    found = [c for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(found) == 1, f"expected one detector process among {children}"
    return found[0]


def test_a_dead_detector_process_loses_no_events(tmp_path, secret):
    run_id = f"recover-{uuid.uuid4().hex[:8]}"
    group = "runwatch-recovery-test"
    t0 = datetime.now(UTC)
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        first = WorkerProcess(broker.bootstrap, secret, tmp_path / "first.log", group=group)
        second = None
        try:
            first.wait_ready(90)
            detector = _detector_pid(first)
            os.kill(detector, signal.SIGSTOP)  # it takes the next batch but never answers

            producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
            sent = []
            for s in range(12):
                if s == 4:
                    ckpt = CheckpointEvent(run_id=run_id, step=4, uri="/ckpt/4.pt", ts=t0 + timedelta(seconds=s))
                    sent.append(producer.send(topics.TELEMETRY, key=run_id.encode(), value=ckpt.to_json()))
                step = StepEvent(run_id=run_id, step=s, loss=math.nan if s >= 8 else 1.0, ts=t0 + timedelta(seconds=s))
                sent.append(producer.send(topics.TELEMETRY, key=run_id.encode(), value=step.to_json()))
            producer.flush()
            producer.close()
            partition = sent[-1].get(timeout=10).partition
            last_offset = sent[-1].get(timeout=10).offset

            os.kill(detector, signal.SIGKILL)
            code = first.process.wait(60)
            assert code != 0, "the worker must fail when its detector process dies"
            assert "detector process exited with code -9" in first.log_path.read_text()
            # Nothing of the run was acknowledged: its events stay for the next worker.
            assert committed_offset(broker.bootstrap, group, topics.TELEMETRY, partition) <= sent[0].get().offset

            second = WorkerProcess(broker.bootstrap, secret, tmp_path / "second.log", group=group)
            second.wait_ready(90)

            def kinds(records):
                return [a.kind for a in (decode_action(r.value) for r in records if r.key == run_id.encode())]

            actions = kinds(read_topic(broker.bootstrap, topics.ACTIONS, lambda rs: "rollback" in kinds(rs), 60))
            assert actions == ["alert", "rollback"]
            eventually(lambda: committed_offset(broker.bootstrap, group, topics.TELEMETRY, partition) > last_offset,
                       30, "the second worker to commit the run's events")
        finally:
            first.stop()
            if second is not None:
                second.stop()
