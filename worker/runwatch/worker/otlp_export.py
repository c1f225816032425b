"""The worker's metrics pushed over OTLP/HTTP (``runwatch worker --otlp-endpoint URL``, the ``otlp`` extra).

The figures are the Prometheus collector's (metrics_server.py's ``WorkerCollector``), not a second count:
each counter and gauge family it yields is an OpenTelemetry observable instrument of the same name, whose
callback reads the family from one ``collect()`` shared by every callback of a collection cycle. The
detection latency is the exception: the SDK has no observable histogram, so a real SDK ``Histogram`` is
recorded into from where the Prometheus one is fed (``LatencyHistogram.observe``: once per finding, on the
event loop), with the same bucket bounds; a backend then sees a histogram, as a scrape does, rather than
one series per bound. The SDK's ``PeriodicExportingMetricReader`` exports every ``interval_s`` from a
thread of its own (cumulative temporality, the exporter's default: counters as they read at a scrape).

Imported only when the option is given: ``opentelemetry`` is never loaded otherwise (nor ever by the
training side). docs/operations.md lists what is exported.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from runwatch.worker.latency_histogram import BUCKETS
from runwatch.worker.metrics_server import WorkerCollector

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from runwatch.worker.health import WorkerHealth

log = logging.getLogger(__name__)

SERVICE_NAME = "runwatch-worker"  # (unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one)
LATENCY = "runwatch_detection_latency_seconds"

# The collector's families but the latency histogram: (name, observable kind, unit, description). A test
# checks that these are exactly the families the collector yields. Counts have no unit (not "1": the
# OTLP-to-Prometheus translation would name a gauge of unit "1" ``..._ratio``); "s" keeps ``_seconds``.
FAMILIES: tuple[tuple[str, str, str, str], ...] = (
    ("runwatch_worker_ready", "gauge", "", "1 when the worker is ready (its /readyz answers 200), else 0"),
    ("runwatch_events", "counter", "", "telemetry events read and handed to the detector process"),
    ("runwatch_events_shed", "counter", "", "telemetry events shed over their run's budget"),
    ("runwatch_deadletters", "counter", "", "records published to runwatch.deadletter, by reason"),
    ("runwatch_findings", "counter", "", "findings published, by detector and severity"),
    ("runwatch_actions", "counter", "", "signed actions published, by kind"),
    ("runwatch_runs_held", "gauge", "", "runs whose detectors this worker holds now"),
    ("runwatch_runs_let_go", "counter", "", "runs let go without their run_end, by reason"),
    (
        "runwatch_last_step_timestamp_seconds",
        "gauge",
        "s",
        "event time of the last step seen per run and rank (runs held only; capped ranks per run)",
    ),
    ("runwatch_publish_failures", "counter", "", "publish attempts that failed"),
)


def _resource() -> Resource:
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    return Resource.create({} if named else {"service.name": SERVICE_NAME})  # (merges OTEL_RESOURCE_*)


class OtlpExporter:
    """Exports ``collector``'s figures and the latency histogram to ``endpoint`` (the full URL, e.g.
    ``http://collector:4318/v1/metrics``) every ``interval_s``; nothing but ``runwatch_worker_ready 0``
    until ``watch`` is given the worker's health. ``exporter``: another ``MetricExporter`` (tests)."""

    def __init__(self, endpoint: str, interval_s: float = 15.0, *, exporter: MetricExporter | None = None):
        self.endpoint = endpoint
        self.collector = WorkerCollector()
        self._lock = threading.Lock()  # (the reader's thread and a force_flush caller may collect at once)
        self._families: dict[str, Metric] = {}
        self._served: set[str] = set()
        self.reader = PeriodicExportingMetricReader(
            exporter or OTLPMetricExporter(endpoint=endpoint),
            export_interval_millis=interval_s * 1000.0,
        )
        self.provider = MeterProvider(
            metric_readers=[self.reader],
            resource=_resource(),
            # (the instruments no view names keep their default aggregation)
            views=[View(instrument_name=LATENCY, aggregation=ExplicitBucketHistogramAggregation(BUCKETS))],
            shutdown_on_exit=False,  # (close() does it, where the metrics server is closed)
        )
        meter = self.provider.get_meter("runwatch.worker")
        for name, kind, unit, description in FAMILIES:
            make = meter.create_observable_counter if kind == "counter" else meter.create_observable_gauge
            make(name, callbacks=[self._callback(name, kind)], unit=unit, description=description)
        self.latency = meter.create_histogram(
            LATENCY,
            unit="s",
            description="from the event time of what a finding is about to the broker's acknowledgement "
            "of its record",
        )
        log.info("exporting metrics over OTLP/HTTP to %s every %gs", endpoint, interval_s)

    def watch(self, health: WorkerHealth) -> None:
        """The worker's figures from now on; its latency observations are recorded here too."""
        self.collector.health = health
        health.latency.listeners.append(self.latency.record)

    def _callback(self, name: str, kind: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        suffix = "_total" if kind == "counter" else ""

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            family = self._family(name)
            if family is None:
                return []
            return [Observation(s.value, dict(s.labels)) for s in family.samples if s.name == name + suffix]

        return observe

    def _family(self, name: str) -> Metric | None:
        # One collect() per cycle: a callback asking for a family already served from the snapshot is
        # the next cycle's first, and takes a new one (no clock, and the figures of one export agree).
        with self._lock:
            if not self._families or name in self._served:
                self._families = {f.name: f for f in self.collector.collect()}
                self._served = set()
            self._served.add(name)
            return self._families.get(name)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        return self.reader.force_flush(timeout_millis=timeout_s * 1000.0)

    def close(self) -> None:
        """A last export, then the reader's thread stops."""
        self.provider.shutdown(timeout_millis=5_000)
