"""The worker's metrics over OTLP/HTTP without a broker: a real HTTP server in this process receives the
exporter's POST to /v1/metrics, its protobuf body is decoded with OpenTelemetry's own message, and the
figures are those the Prometheus collector reads from the same (fake) worker state."""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from runwatch.cli import worker as worker_cli
from runwatch.worker.latency_histogram import BUCKETS, LatencyHistogram
from runwatch.worker.metrics_server import WorkerCollector
from runwatch.worker.otlp_export import FAMILIES, LATENCY, OtlpExporter
from runwatch.worker.processor import WorkerCounters
from tests.support.otlp_receiver import OtlpReceiver, attributes, decode, value


def _health() -> SimpleNamespace:
    counters = WorkerCounters(runs=2, deadlettered=3, detector_errors=1)
    counters.findings[("nonfinite", "critical")] += 2
    counters.actions["rollback"] += 1
    return SimpleNamespace(
        detectors=SimpleNamespace(counters=counters, step_times={"r": {0: 1700000000.5, 3: 1700000001.0}}),
        events_submitted=40,
        budget=None,
        shed_letters=5,
        publish_failures=0,
        latency=LatencyHistogram(),
        ready=lambda: (True, "ok"),
    )


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    try:
        yield r
    finally:
        r.close()


def test_the_collectors_figures_reach_an_otlp_receiver(receiver):
    posts = receiver.posts
    url = worker_cli.otlp_metrics_endpoint(receiver.url, {})
    exporter = OtlpExporter(url, interval_s=3600.0)  # (exported by force_flush, not by the interval)
    try:
        assert exporter.force_flush()
        path, kind, before = posts.get(timeout=10)
        health = _health()
        exporter.watch(health)  # type: ignore[arg-type]
        health.latency.observe(0.04)
        health.latency.observe(7.0)
        assert exporter.force_flush()
        _, _, after = posts.get(timeout=10)
    finally:
        exporter.close()
    assert path == "/v1/metrics" and kind == "application/x-protobuf"
    early = decode(before)
    assert set(early) == {"runwatch_worker_ready"}  # (the worker not built yet: nothing else)
    assert early["runwatch_worker_ready"].gauge.data_points[0].as_double == 0.0

    metrics = decode(after)
    # (no run let go yet: a family with no series is sent by neither)
    assert set(metrics) == {name for name, *_ in FAMILIES if name != "runwatch_runs_let_go"} | {LATENCY}
    # what the Prometheus collector reads from the same state, family by family
    collector = WorkerCollector()
    collector.health = health  # type: ignore[assignment]
    families = {f.name: f for f in collector.collect()}
    for name, kind_, *_ in FAMILIES:
        suffix = "_total" if kind_ == "counter" else ""
        expected = {
            tuple(sorted(s.labels.items())): s.value
            for s in families[name].samples
            if s.name == name + suffix
        }
        if name not in metrics:
            assert expected == {}, name
            continue
        metric = metrics[name]
        if kind_ == "counter":
            assert metric.sum.is_monotonic, name
            points = metric.sum.data_points
        else:
            points = metric.gauge.data_points
        got = {tuple(sorted(attributes(p).items())): value(p) for p in points}
        assert got == expected, name
    assert metrics["runwatch_runs_held"].unit == "" and metrics[LATENCY].unit == "s"
    held = metrics["runwatch_runs_held"].gauge.data_points
    assert [value(p) for p in held] == [2]
    (events,) = metrics["runwatch_events"].sum.data_points
    assert value(events) == 40
    steps = {
        attributes(p)["rank"]: p.as_double
        for p in metrics["runwatch_last_step_timestamp_seconds"].gauge.data_points
    }
    assert steps == {"0": 1700000000.5, "3": 1700000001.0}
    # the latency: a real histogram, the Prometheus buckets' bounds
    (latency,) = metrics[LATENCY].histogram.data_points
    assert list(latency.explicit_bounds) == list(BUCKETS)
    assert latency.count == 2 and abs(latency.sum - 7.04) < 1e-9
    assert latency.bucket_counts[BUCKETS.index(0.05)] == 1 and latency.bucket_counts[BUCKETS.index(10.0)] == 1
    assert sum(latency.bucket_counts) == 2


def test_the_families_exported_are_the_ones_the_collector_yields():
    collector = WorkerCollector()
    collector.health = _health()  # type: ignore[assignment]
    yielded = {f.name: f.type for f in collector.collect()}
    assert yielded.pop(LATENCY) == "histogram"
    assert yielded == {name: kind for name, kind, *_ in FAMILIES}


def test_only_the_option_turns_the_export_on():
    resolve = worker_cli.otlp_metrics_endpoint
    assert resolve(None, {}) is None  # (off by default)
    assert resolve("http://c:4318", {}) == "http://c:4318/v1/metrics"
    assert resolve("http://c:4318/", {}) == "http://c:4318/v1/metrics"
    assert resolve("http://c:4318/v1/metrics", {}) == "http://c:4318/v1/metrics"
    # a cluster's OTEL_* variables, meant for its instrumented programs, do not turn a worker's export on
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "x"}
    assert resolve(None, env) is None
    assert resolve("http://opt:4318", env) == "http://opt:4318/v1/metrics"


def test_the_option_without_the_extra_is_one_line_naming_it(monkeypatch):
    real_import = builtins.__import__

    def no_opentelemetry(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "opentelemetry" or name == "runwatch.worker.otlp_export":
            raise ModuleNotFoundError(f"No module named {name!r}", name="opentelemetry")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_opentelemetry)
    monkeypatch.setattr(worker_cli.extras, "installed_table", lambda: {})  # (metadata older than the extra)
    result = CliRunner().invoke(
        worker_cli.worker,
        ["--bootstrap", "127.0.0.1:1", "--web-port", "0", "--otlp-endpoint", "http://127.0.0.1:4318"],
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [
        "error: runwatch worker --otlp-endpoint needs the 'otlp' extra: pip install 'runwatch[otlp]'"
    ]
