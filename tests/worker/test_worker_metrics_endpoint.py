"""The worker's Prometheus metrics (issue 39): `runwatch worker --metrics-port P` serves them, and the
stall rule an operator would write, ``time() - runwatch_last_step_timestamp_seconds > 60``, fires on a
run whose steps stopped while its heartbeats go on, and not on a healthy one. No Prometheus server: the
test scrapes the endpoint, parses the text with prometheus_client's parser and evaluates the rule itself.

The stalled rank's last step is stamped 90 s in the past (the worker takes event times as they are, within
``limits.max_past_s``), so the test does not wait a minute for the rule to hold.
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runwatch.local.broker import free_port
from runwatch.local.worker_process import WorkerProcess
from runwatch.producer import RunWatch
from tests.conftest import eventually

pytestmark = pytest.mark.integration

STALL_AFTER_S = 60.0  # the rule's threshold


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)], from the endpoint's text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def stall_rule(samples: dict[str, list[tuple[dict[str, str], float]]], now: float) -> set[tuple[str, str]]:
    """The (run_id, rank) series for which ``time() - runwatch_last_step_timestamp_seconds > 60`` holds."""
    return {
        (labels["run_id"], labels["rank"])
        for labels, ts in samples.get("runwatch_last_step_timestamp_seconds", [])
        if now - ts > STALL_AFTER_S
    }


def series(samples: dict[str, list[tuple[dict[str, str], float]]], run_id: str) -> dict[str, float]:
    return {
        labels["rank"]: ts
        for labels, ts in samples.get("runwatch_last_step_timestamp_seconds", [])
        if labels["run_id"] == run_id
    }


@pytest.fixture
def metrics_worker(own_broker, action_keys, tmp_path) -> Iterator[tuple[WorkerProcess, int]]:
    port = free_port()
    # (a broker of its own: the latency histogram then holds only this test's findings, not the backlog of
    # earlier tests that a late-joining worker reads, whose latency is real but minutes long)
    w = WorkerProcess(
        own_broker.bootstrap,
        action_keys.signing,
        tmp_path / "worker.log",
        group=f"metrics-{uuid.uuid4().hex[:6]}",
        extra_args=("--metrics-port", str(port)),
    )
    try:
        w.wait_ready(90)
        yield w, port
    finally:
        w.stop()


def test_the_stall_rule_fires_on_the_stalled_rank_only(own_broker, metrics_worker):
    worker, port = metrics_worker
    tag = uuid.uuid4().hex[:6]
    stalled_run, healthy_run, ended_run = f"stalled-{tag}", f"healthy-{tag}", f"ended-{tag}"
    # The stalled run: two ranks; rank 1's steps stopped 90 s ago, rank 0 steps on, both send heartbeats.
    ranks = [RunWatch(stalled_run, own_broker.bootstrap, rank=r, world_size=2, spool=False) for r in (0, 1)]
    healthy = RunWatch(healthy_run, own_broker.bootstrap, spool=False)
    ended = RunWatch(ended_run, own_broker.bootstrap, spool=False)
    try:
        long_ago = datetime.now(UTC) - timedelta(seconds=90)
        for step in range(5):
            ranks[1].step(step, loss=1.0, ts=long_ago + timedelta(milliseconds=step))
        for step in range(5):
            ended.step(step, loss=1.0)
        # (a NaN: a finding, whose detection latency the histogram observes)
        for step in range(12):
            healthy.step(step, loss=float("nan") if step == 11 else 1.0 / (step + 1), grad_norm=1.0)
        deadline = time.monotonic() + 60
        fired: set[tuple[str, str]] = set()
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        step = 5
        while time.monotonic() < deadline:
            ranks[0].step(step, loss=1.0)
            healthy.step(step + 7, loss=1.0, grad_norm=1.0)
            for rw in ranks:
                rw.heartbeat(4 if rw is ranks[1] else step, in_sync=rw is ranks[0])
            step += 1
            samples = scrape(port)
            fired = stall_rule(samples, time.time())
            if (
                (stalled_run, "1") in fired
                and healthy_run
                in {labels["run_id"] for labels, _ in samples.get("runwatch_last_step_timestamp_seconds", [])}
                and series(samples, ended_run)
                and samples.get("runwatch_detection_latency_seconds_count", [({}, 0.0)])[0][1] >= 1
            ):
                break
            time.sleep(0.5)
        assert (stalled_run, "1") in fired, f"the stall rule did not fire on rank 1: {sorted(fired)}"
        # only that rank: the stalled run's rank 0 and the healthy run step on
        assert {s for s in fired if s[0] in (stalled_run, healthy_run, ended_run)} == {(stalled_run, "1")}
        assert set(series(samples, stalled_run)) == {"0", "1"}
        assert abs(series(samples, stalled_run)["1"] - (long_ago.timestamp() + 0.004)) < 0.01
        assert time.time() - series(samples, healthy_run)["0"] < 30

        # the other figures are there, and say what happened
        (held,) = samples["runwatch_runs_held"]
        assert held[1] >= 3
        assert samples["runwatch_events_total"][0][1] >= 30
        findings = {(lb["detector"], lb["severity"]): v for lb, v in samples["runwatch_findings_total"]}
        assert findings, "no finding counted (the NaN step)"
        latency_count = samples["runwatch_detection_latency_seconds_count"][0][1]
        assert latency_count >= 1
        assert 0 < samples["runwatch_detection_latency_seconds_sum"][0][1] < 30 * latency_count
        assert samples["runwatch_worker_ready"][0][1] == 1.0
        reasons = {lb["reason"] for lb, _ in samples["runwatch_deadletters_total"]}
        assert reasons == {"invalid", "detector_error", "budget"}

        # a run let go (its run_end) leaves the metrics: the series are of the runs held only
        ended.close(timeout=5)
        eventually(lambda: not series(scrape(port), ended_run), 30, "the ended run's series to go")
    finally:
        for rw in (*ranks, healthy, ended):
            rw.close(timeout=2)
    assert worker.health()[0] == 200
