"""The worker's detectors run in a child process. If that child dies, the worker must exit non-zero
(so that its supervisor restarts it) without having committed the events the child never answered:
the next worker reads them again, and the run's rollback is still issued. Nothing is lost."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.schema import CheckpointEvent, StepEvent, decode_action
from runwatch.local.broker import EmbeddedBroker, committed_offset, ensure_topics
from runwatch.local.worker_process import WorkerProcess
from tests.conftest import eventually, read_topic

pytestmark = pytest.mark.integration


def _detector_pid(worker: WorkerProcess) -> int:
    """The worker's detector process: its child that is not multiprocessing's resource tracker."""
    pid = worker.process.pid
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    found = [c for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(found) == 1, f"expected one detector process among {children}"
    return found[0]


def test_a_dead_detector_process_loses_no_events(tmp_path, action_keys):
    run_id = f"recover-{uuid.uuid4().hex[:8]}"
    group = "runwatch-recovery-test"
    t0 = datetime.now(UTC)
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        first = WorkerProcess(broker.bootstrap, action_keys.signing, tmp_path / "first.log", group=group)
        second = None
        try:
            first.wait_ready(90)
            detector = _detector_pid(first)
            os.kill(detector, signal.SIGSTOP)  # it takes the next batch but never answers

            producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
            sent = []
            for s in range(30):  # a checkpoint at 1 (confirmed good at 21), NaN from 26
                if s == 1:
                    ckpt = CheckpointEvent(
                        run_id=run_id, step=1, uri="/ckpt/1.pt", ts=t0 + timedelta(seconds=s)
                    )
                    sent.append(producer.send(topics.TELEMETRY, key=run_id.encode(), value=ckpt.to_json()))
                step = StepEvent(
                    run_id=run_id, step=s, loss=math.nan if s >= 26 else 1.0, ts=t0 + timedelta(seconds=s)
                )
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
            assert (
                committed_offset(broker.bootstrap, group, topics.TELEMETRY, partition) <= sent[0].get().offset
            )

            second = WorkerProcess(
                broker.bootstrap, action_keys.signing, tmp_path / "second.log", group=group
            )
            second.wait_ready(90)

            def kinds(records):
                return [a.kind for a in (decode_action(r.value) for r in records if r.key == run_id.encode())]

            actions = kinds(
                read_topic(broker.bootstrap, topics.ACTIONS, lambda rs: "rollback" in kinds(rs), 60)
            )
            assert actions == ["alert", "rollback"]
            eventually(
                lambda: committed_offset(broker.bootstrap, group, topics.TELEMETRY, partition) > last_offset,
                30,
                "the second worker to commit the run's events",
            )
        finally:
            first.stop()
            if second is not None:
                second.stop()


def test_a_frozen_detector_process_fails_the_worker_and_the_health_endpoint_says_so_first(
    tmp_path, action_keys
):
    """A child that stops answering (SIGSTOP: alive, but frozen) must not leave a worker that looks
    alive while nothing moves: /livez turns 503 within its stuck threshold (5 s), and the worker exits
    non-zero once the reply timeout (here 6 s) has passed, within the failure grace period."""
    run_id = f"frozen-{uuid.uuid4().hex[:8]}"
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        worker = WorkerProcess(
            broker.bootstrap,
            action_keys.signing,
            tmp_path / "worker.log",
            group="runwatch-frozen-test",
            extra_args=("--detector-timeout", "6"),
        )
        try:
            worker.wait_ready(90)
            assert eventually(lambda: worker.health("/readyz")[0] == 200, 30, "the worker to be ready")
            status, health = worker.health()
            assert status == 200 and health["live"] and health["detector_process"]["alive"]
            detector = health["detector_process"]["pid"]
            assert detector == _detector_pid(worker)

            os.kill(detector, signal.SIGSTOP)
            frozen_at = time.monotonic()
            producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
            producer.send(
                topics.TELEMETRY,
                key=run_id.encode(),
                value=StepEvent(run_id=run_id, step=0, loss=1.0).to_json(),
            )
            producer.flush()
            producer.close()

            # The health endpoint reports it while the worker is still running ...
            def unhealthy():
                status, body = worker.health("/livez")
                return (
                    status == 503
                    and "has neither answered nor made progress" in body["reason"]
                    and worker.process.poll() is None
                )

            eventually(unhealthy, 30, "/livez to report the frozen detector process", interval=0.2)
            reported_after = time.monotonic() - frozen_at
            # ... and then the worker exits non-zero by itself.
            code = worker.process.wait(60)
            exited_after = time.monotonic() - frozen_at
            print(
                f"frozen detector: /livez 503 after {reported_after:.1f} s, worker exit {code} after "
                f"{exited_after:.1f} s"
            )
            assert code != 0
            assert reported_after < exited_after
            # (reply timeout 6 s + the reader's 0.5 s poll + at most the 15 s grace, with slack for a busy
            # machine)
            assert exited_after < 6 + 0.5 + 15 + 15, exited_after
            log = worker.log_path.read_text()
            assert "has neither answered nor reported progress for" in log and "frozen or stuck" in log
        finally:
            worker.stop()
            try:
                os.kill(detector, signal.SIGKILL)
            except (ProcessLookupError, UnboundLocalError):
                pass


def test_results_that_cannot_be_delivered_fail_the_worker_without_committing_past_them(tmp_path, action_keys):
    """The broker becomes unreachable between the worker reading a malformed message and publishing
    its dead letter: the worker must neither commit past the message nor wait silently. It fails
    (the health endpoint says why), exits non-zero, and its successor dead-letters the message."""
    from runwatch.local.broker import free_port
    from runwatch.local.netcut import NetCut

    run_id = f"undelivered-{uuid.uuid4().hex[:8]}"
    group = "runwatch-undelivered-test"
    proxy_port = free_port()
    with (
        EmbeddedBroker(log_path=tmp_path / "broker.log", advertised=f"127.0.0.1:{proxy_port}") as broker,
        NetCut(("127.0.0.1", broker.port), port=proxy_port) as net,
    ):
        ensure_topics(net.bootstrap)
        worker = WorkerProcess(
            net.bootstrap,
            action_keys.signing,
            tmp_path / "worker.log",
            group=group,
            extra_args=("--delivery-timeout", "5", "--detector-timeout", "120"),
        )
        second = None
        detector = None
        try:
            worker.wait_ready(90)
            detector = worker.health()[1]["detector_process"]["pid"]
            os.kill(detector, signal.SIGSTOP)  # hold the message inside the worker ...
            producer = KafkaProducer(bootstrap_servers=net.bootstrap, api_version=topics.KAFKA_API_VERSION)
            meta = producer.send(topics.TELEMETRY, key=run_id.encode(), value=b"{ not json").get(timeout=30)
            producer.close()
            eventually(  # (not pending_requests: a timer's tick is a request too)
                lambda: worker.health()[1]["events_submitted"] >= 1,
                30,
                "the worker to hand the message to its detector process",
            )
            net.cut()  # ... then the broker goes away before its dead letter can be published
            os.kill(detector, signal.SIGCONT)

            def says_why():
                status, body = worker.health("/livez")
                return status == 503 and "not delivered" in body["reason"]

            eventually(
                says_why, 60, "the health endpoint to say the results were not delivered", interval=0.2
            )
            assert worker.process.wait(60) != 0
            assert "were not delivered" in worker.log_path.read_text()

            net.restore()
            assert committed_offset(net.bootstrap, group, topics.TELEMETRY, meta.partition) <= meta.offset
            second = WorkerProcess(net.bootstrap, action_keys.signing, tmp_path / "second.log", group=group)
            second.wait_ready(90)

            def ours(records):
                return [r for r in records if r.key == run_id.encode()]

            [letter] = ours(read_topic(net.bootstrap, topics.DEADLETTER, lambda rs: bool(ours(rs)), 60))
            assert letter.value and b"not JSON" in letter.value
            eventually(
                lambda: (
                    committed_offset(net.bootstrap, group, topics.TELEMETRY, meta.partition) > meta.offset
                ),
                30,
                "the second worker to commit past the message",
            )
        finally:
            if detector is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(detector, signal.SIGCONT)
            worker.stop()
            if second is not None:
                second.stop()
