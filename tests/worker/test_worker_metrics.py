"""The worker's metrics without a broker: the processor's per-rank step times (only runs held, bounded
per run), the figures a tick hands over when asked, the latency histogram's buckets, and the text the
endpoint serves (prometheus_client's own parser reads it back)."""

from __future__ import annotations

import urllib.request
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from runwatch.contract.schema import RunEndEvent, StepEvent
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.detector_process import handle
from runwatch.worker.latency_histogram import LatencyHistogram
from runwatch.worker.metrics_server import MetricsServer
from runwatch.worker.processor import TelemetryProcessor, WorkerCounters
from runwatch.worker.step_times import StepTimes
from tests.support.action_keys import SEED

T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)
WALL = T0 + timedelta(minutes=5)


def _step(run_id: str, step: int, rank: int = 0, loss: float = 1.0, world: int | None = None) -> bytes:
    extra = {"world_size": world} if world else {}
    return StepEvent(
        run_id=run_id, rank=rank, step=step, loss=loss, ts=T0 + timedelta(seconds=step), **extra
    ).to_json()


def test_a_tick_that_asks_gets_each_held_runs_last_step_per_rank_and_a_run_let_go_leaves():
    proc = TelemetryProcessor(RunwatchConfig(), SEED, clock=lambda: WALL)
    raw = [(_step("a", s, rank=r, world=2), b"a", None, None, None) for s in range(3) for r in (0, 1)]
    raw += [(_step("b", s), b"b", None, None, None) for s in range(5)]
    handle(proc, "events", raw)
    assert handle(proc, "tick", (False, [])).step_times is None  # (not asked: nothing shipped)
    steps = handle(proc, "tick", (False, [], True)).step_times
    assert steps == {
        "a": {0: (T0 + timedelta(seconds=2)).timestamp(), 1: (T0 + timedelta(seconds=2)).timestamp()},
        "b": {0: (T0 + timedelta(seconds=4)).timestamp()},
    }
    end = RunEndEvent(run_id="b", status="completed", ts=T0 + timedelta(seconds=5)).to_json()
    handle(proc, "events", [(end, b"b", None, None, None)])
    assert set(handle(proc, "tick", (False, [], True)).step_times or {}) == {"a"}


def test_findings_are_counted_by_detector_and_severity_and_timed_from_their_records_arrival():
    proc = TelemetryProcessor(RunwatchConfig(), SEED, clock=lambda: WALL)
    # the events' times are 5 minutes old (a backlog, a replay, a simulated clock): the latency starts
    # when the NaN step's record reached the broker (its record time), not at its event time
    arrived = (WALL - timedelta(milliseconds=40)).timestamp()
    raw = [
        (_step("n", s, loss=float("nan") if s == 9 else 1.0), b"n", None, None, arrived if s == 9 else None)
        for s in range(10)
    ]
    reply = handle(proc, "events", raw)
    assert sum(reply.counters.findings.values()) == reply.counters.anomalies >= 1
    assert all(severity in ("info", "warning", "critical") for _, severity in reply.counters.findings)
    assert reply.finding_times and all(abs(t - arrived) < 1e-3 for t in reply.finding_times)


def test_a_run_of_many_ranks_keeps_only_its_most_behind_ones():
    times = StepTimes()
    for rank in range(1000):
        times.seen("big", rank, T0 + timedelta(seconds=rank))
    for rank in range(1000):  # every rank steps on but 500, which hangs
        if rank != 500:
            times.seen("big", rank, T0 + timedelta(hours=1, seconds=rank))
    times.seen("big", 500, T0 - timedelta(hours=1))  # (a step read late does not move it back)
    kept = times.export(max_ranks=64)["big"]
    assert len(kept) == 64
    assert kept[500] == (T0 + timedelta(seconds=500)).timestamp()
    assert set(kept) == {500, *range(63)}
    times.forget("big")
    assert times.export() == {}


def test_a_split_runs_groups_come_back_under_the_runs_id():
    times = StepTimes()
    times.seen("run#0", 0, T0)
    times.seen("run#1", 8, T0)
    assert times.export() == {"run": {0: T0.timestamp(), 8: T0.timestamp()}}


def test_latency_buckets_are_cumulative_and_end_with_inf():
    h = LatencyHistogram((0.1, 1.0))
    h.observe_since([99.95, 99.5, 50.0], now=100.0)
    h.observe(-0.2)  # (an event time a little ahead of the worker's clock: 0)
    buckets, count, total = h.cumulative()
    assert buckets == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert count == 4
    assert abs(total - 50.55) < 1e-9


def test_the_endpoint_serves_the_figures_as_prometheus_text():
    counters = WorkerCounters(runs=2, deadlettered=3, detector_errors=1)
    counters.findings[("nonfinite", "critical")] += 2
    counters.actions["rollback"] += 1
    latency = LatencyHistogram()
    latency.observe(0.04)
    health = SimpleNamespace(
        detectors=SimpleNamespace(counters=counters, step_times={"r": {0: 1700000000.5, 3: 1700000001.0}}),
        events_submitted=40,
        budget=None,
        shed_letters=5,
        publish_failures=0,
        latency=latency,
        ready=lambda: (True, "ok"),
    )
    server = MetricsServer("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            before = resp.read().decode()
        server.collector.health = health  # type: ignore[assignment]
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        server.close()
    assert "runwatch_worker_ready 0.0" in before and "runwatch_events_total" not in before
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("runwatch_last_step_timestamp_seconds", (("rank", "3"), ("run_id", "r")))] == 1700000001.0
    assert samples[("runwatch_findings_total", (("detector", "nonfinite"), ("severity", "critical")))] == 2
    assert samples[("runwatch_actions_total", (("kind", "rollback"),))] == 1
    assert samples[("runwatch_runs_held", ())] == 2
    assert samples[("runwatch_events_total", ())] == 40
    assert samples[("runwatch_deadletters_total", (("reason", "invalid"),))] == 3
    assert samples[("runwatch_deadletters_total", (("reason", "budget"),))] == 5
    assert samples[("runwatch_detection_latency_seconds_bucket", (("le", "0.05"),))] == 1
    assert samples[("runwatch_detection_latency_seconds_bucket", (("le", "0.025"),))] == 0
    assert samples[("runwatch_detection_latency_seconds_count", ())] == 1
    assert samples[("runwatch_worker_ready", ())] == 1
