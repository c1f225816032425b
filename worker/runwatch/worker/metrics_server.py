"""The worker's Prometheus metrics (``runwatch worker --metrics-port P``), served by ``prometheus_client``.

Nothing here is updated per event: one collector reads, at scrape time, the figures the worker already
keeps for ``/health`` (health.py): the detector process's counters as of its latest reply (a fresh object
per reply, never changed after: safe to read from this thread), the runs' last step times that the
detector process hands over at most once a second while metrics are on (step_times.py), and the detection
latency histogram the event loop fills once per finding (latency_histogram.py). The endpoint is a thread of
its own, like the health endpoint: a scrape never waits for the event loop. docs/operations.md lists the
metrics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from runwatch.worker.step_times import MAX_RANKS_PER_RUN

if TYPE_CHECKING:
    from runwatch.worker.health import WorkerHealth

log = logging.getLogger(__name__)


class WorkerCollector(Collector):
    """The worker's figures as metric families; nothing (but ``runwatch_up``) until the worker is built."""

    def __init__(self) -> None:
        self.health: WorkerHealth | None = None

    def collect(self) -> Iterator[Metric]:
        health = self.health
        up = GaugeMetricFamily(
            "runwatch_worker_ready", "1 when the worker is ready (its /readyz answers 200), else 0"
        )
        up.add_metric([], 0.0 if health is None else float(health.ready()[0]))
        yield up
        if health is None:
            return
        counters = health.detectors.counters  # (one reply's: replaced whole, never changed)

        events = CounterMetricFamily(
            "runwatch_events", "telemetry events read and handed to the detector process"
        )
        events.add_metric([], float(health.events_submitted))
        yield events
        shed = CounterMetricFamily(
            "runwatch_events_shed", "telemetry events shed over their run's budget (never judged)"
        )
        shed.add_metric([], float(health.budget.shed_total if health.budget is not None else 0))
        yield shed
        letters = CounterMetricFamily(
            "runwatch_deadletters",
            "records the worker published to runwatch.deadletter, by why: invalid (refused at decoding: "
            "schema, key, split run), detector_error (a run's handling raised: its state was reset), budget "
            "(one per run and report of events shed)",
            labels=["reason"],
        )
        letters.add_metric(["invalid"], float(counters.deadlettered))
        letters.add_metric(["detector_error"], float(counters.detector_errors))
        letters.add_metric(["budget"], float(health.shed_letters))
        yield letters
        findings = CounterMetricFamily(
            "runwatch_findings",
            "findings published, by detector and severity",
            labels=["detector", "severity"],
        )
        for (detector, severity), count in sorted(counters.findings.items()):
            findings.add_metric([detector, severity], float(count))
        yield findings
        actions = CounterMetricFamily(
            "runwatch_actions", "signed actions published, by kind", labels=["kind"]
        )
        for kind, count in sorted(counters.actions.items()):
            actions.add_metric([kind], float(count))
        yield actions
        held = GaugeMetricFamily("runwatch_runs_held", "runs whose detectors this worker holds now")
        held.add_metric([], float(counters.runs))
        yield held
        let_go = CounterMetricFamily(
            "runwatch_runs_let_go", "runs let go without their run_end, by why", labels=["reason"]
        )
        for reason, count in sorted(counters.runs_let_go.items()):
            let_go.add_metric([reason], float(count))
        yield let_go
        steps = GaugeMetricFamily(
            "runwatch_last_step_timestamp_seconds",
            "event time of the last step seen per run and rank (the runs held only; at most "
            f"{MAX_RANKS_PER_RUN} ranks per run: the most behind)",
            labels=["run_id", "rank"],
        )
        for run_id, ranks in sorted(health.detectors.step_times.items()):
            for rank, ts in sorted(ranks.items()):
                steps.add_metric([run_id, str(rank)], ts)
        yield steps
        buckets, _count, total = health.latency.cumulative()  # (the count: its +Inf bucket)
        latency = HistogramMetricFamily(
            "runwatch_detection_latency_seconds",
            "from the event time of what a finding is about to the broker's acknowledgement of its record",
        )
        latency.add_metric([], buckets=buckets, sum_value=total)
        yield latency
        failures = CounterMetricFamily(
            "runwatch_publish_failures", "publish attempts that failed (the worker fails after them)"
        )
        failures.add_metric([], float(health.publish_failures))
        yield failures


class MetricsServer:
    """``/metrics`` on ``host:port`` (prometheus_client's threaded server), from ``collector``."""

    def __init__(self, host: str, port: int):
        self.collector = WorkerCollector()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        self._server: Any
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        log.info("metrics endpoint on http://%s:%d/metrics", host, self.port)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
