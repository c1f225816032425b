"""The worker's metrics over OTLP (issue 39): `runwatch worker --otlp-endpoint URL` started the way users
start it pushes its figures to an OTLP/HTTP receiver (a real HTTP server in this process; no
OpenTelemetry Collector), the runs' last step times included (asked of the detector process only while
metrics are on), and a finding's detection latency as a histogram."""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from runwatch.local.worker_process import WorkerProcess
from runwatch.producer import RunWatch
from tests.support.otlp_receiver import OtlpReceiver, attributes, decode, value

pytestmark = pytest.mark.integration


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    try:
        yield r
    finally:
        r.close()


def test_a_worker_pushes_its_metrics_over_otlp(own_broker, action_keys, tmp_path, receiver):
    # (a broker of its own: the latency histogram then holds only this test's finding, not the minutes-old
    # backlog of earlier tests that a late-joining worker reads)
    w = WorkerProcess(
        own_broker.bootstrap,
        action_keys.signing,
        tmp_path / "worker.log",
        group=f"otlp-{uuid.uuid4().hex[:6]}",
        extra_args=("--otlp-endpoint", receiver.url, "--otlp-interval-s", "0.5"),
    )
    run_id = f"otlp-{uuid.uuid4().hex[:6]}"
    rw = RunWatch(run_id, own_broker.bootstrap, spool=False)
    try:
        w.wait_ready(90)
        for step in range(12):  # (a NaN: a finding, whose detection latency the histogram records)
            rw.step(step, loss=float("nan") if step == 11 else 1.0 / (step + 1), grad_norm=1.0)
        deadline = time.monotonic() + 60
        metrics: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                path, kind, body = receiver.posts.get(timeout=5)
            except queue.Empty:
                continue
            assert path == "/v1/metrics" and kind == "application/x-protobuf"
            metrics = decode(body)
            steps = metrics.get("runwatch_last_step_timestamp_seconds")
            latency = metrics.get("runwatch_detection_latency_seconds")
            if (
                steps is not None
                and any(attributes(p).get("run_id") == run_id for p in steps.gauge.data_points)
                and latency is not None
                and latency.histogram.data_points[0].count >= 1
            ):
                break
        assert "runwatch_last_step_timestamp_seconds" in metrics, sorted(metrics)
        (ready,) = metrics["runwatch_worker_ready"].gauge.data_points
        assert value(ready) == 1.0
        (events,) = metrics["runwatch_events"].sum.data_points
        assert value(events) >= 12
        ranks = {
            attributes(p)["rank"]: value(p)
            for p in metrics["runwatch_last_step_timestamp_seconds"].gauge.data_points
            if attributes(p)["run_id"] == run_id
        }
        assert set(ranks) == {"0"} and time.time() - ranks["0"] < 120
        assert sum(value(p) for p in metrics["runwatch_findings"].sum.data_points) >= 1
        (latency_point,) = metrics["runwatch_detection_latency_seconds"].histogram.data_points
        assert latency_point.count >= 1 and 0 < latency_point.sum < 30 * latency_point.count
    finally:
        rw.close(timeout=5)
        w.stop()
