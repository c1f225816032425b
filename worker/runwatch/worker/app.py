"""The Faust application: consumes telemetry as raw bytes, has the detector process run the
processor on it (worker/runwatch/worker/detector_process.py), and publishes the results.

Built by ``create_app`` (not at import time) so that the bootstrap, config and secret
come from the command line. ``run_worker`` starts it in this process.

The worker (``DetectWorker``) is built in layers: the watch on the telemetry log it reads (log_guard.py),
the pipeline to the detector process (pipeline.py), and here its agent, timers and signal handlers. The
Faust app and its settings: runwatch_app.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faust

from runwatch.contract import topics
from runwatch.contract.schema import DeadLetter
from runwatch.detectors import RunwatchConfig
from runwatch.detectors.offline.replay import TICK_EVERY_S
from runwatch.worker.detector_process import (
    REPLY_TIMEOUT_S,
    DetectorProcess,
    DetectorProcessError,
    Outgoing,
)
from runwatch.worker.health import CommitSensor, WorkerHealth
from runwatch.worker.health_server import HealthServer
from runwatch.worker.log_identity import ID_EVERY_S, LogWatch, TopicIds
from runwatch.worker.pipeline import DELIVERY_TIMEOUT_S, Pipeline
from runwatch.worker.run_budget import BudgetLimits, RunBudget, ShedReport
from runwatch.worker.runwatch_app import RunwatchApp, faust_app, faust_broker_url
from runwatch.worker.state.run_states import StateOptions
from runwatch.worker.state.snapshot import resolve_state_secret

if TYPE_CHECKING:
    from collections.abc import Iterable

    from faust.types import TP

    from runwatch.worker.metrics_server import MetricsServer
    from runwatch.worker.otlp_export import OtlpExporter

# What other modules import from here (the Faust app's settings live in runwatch_app.py)
__all__ = [
    "DETECT_GROUP",
    "DetectWorker",
    "RunwatchApp",
    "create_app",
    "faust_app",
    "faust_broker_url",
    "run_worker",
    "shed_letters",
    "write_ready_file",
]

log = logging.getLogger(__name__)

DETECT_GROUP = topics.DETECT_GROUP
# The prefix of the Faust names of the agent and the timers (``runwatch.worker.app.detect``, ``.tick``, ...):
# the names they had while all of them were defined here, kept as a literal so that where their methods live
# (the agent in pipeline.py, a timer in log_guard.py) or what this module is called never renames them
FAUST_NAMES = "runwatch.worker.app"


def write_ready_file(ready_file: Path, assigned: Iterable[TP]) -> None:
    ready_file.write_text(",".join(sorted(f"{tp.topic}:{tp.partition}" for tp in assigned)))


STEP_TIMES_EVERY_S = 1.0  # with metrics on, a tick asks for the runs' last step times at most this often


def create_app(
    bootstrap: str,
    config: RunwatchConfig,
    secret: bytes,
    *,
    app_id: str = DETECT_GROUP,
    web_port: int | None = 6066,
    web_host: str = "127.0.0.1",
    ready_file: Path | None = None,
    detector_timeout_s: float = REPLY_TIMEOUT_S,
    delivery_timeout_s: float = DELIVERY_TIMEOUT_S,
    baseline_dsn: str | None = None,
    state: StateOptions | None = None,
    partitions: int | None = None,
    health_server: HealthServer | None = None,
    data_dir: Path | None = None,
    state_secret: bytes | None = None,
    metrics_server: MetricsServer | None = None,
    otlp_exporter: OtlpExporter | None = None,
) -> tuple[faust.App, DetectorProcess]:
    """The worker: a Faust agent that batches telemetry to the detector process and publishes what
    comes back. Events are acknowledged (their offsets committed) only once their results are
    delivered and a state checkpoint after them is too (worker/runwatch/worker/state/run_states.py).
    Whatever stops progress (the detector process dies or stops answering, results cannot be published) fails
    the worker: it exits non-zero and its successor reads the events again. ``web_port`` serves the health
    endpoint (worker/runwatch/worker/health.py); None turns it off; ``health_server``: one already
    serving it (``runwatch worker`` starts it before anything else), which this worker takes over.
    ``baseline_dsn``: the ClickHouse the runs' baseline bands are loaded from at their start
    (worker/runwatch/worker/baselines.py). ``state``: the runs' state snapshots to ``runwatch.state``
    (worker/runwatch/worker/state/run_states.py); on by default, signed with ``state_secret``, the workers'
    state key (None: ``$RUNWATCH_STATE_SECRET``; none there raises ``MissingStateSecretError``: the action
    secret is never used for it, worker/runwatch/worker/state/snapshot.py). ``partitions``: the telemetry
    topic's partition count, against which each record's partition is checked. ``metrics_server``: the
    Prometheus endpoint (metrics_server.py) this worker's figures are served on (None: no metrics);
    ``otlp_exporter``: the same figures pushed over OTLP (otlp_export.py; None: none)."""
    worker = DetectWorker(
        bootstrap,
        config,
        secret,
        app_id=app_id,
        web_port=web_port,
        web_host=web_host,
        ready_file=ready_file,
        detector_timeout_s=detector_timeout_s,
        delivery_timeout_s=delivery_timeout_s,
        baseline_dsn=baseline_dsn,
        state=state,
        partitions=partitions,
        health_server=health_server,
        data_dir=data_dir,
        state_secret=state_secret,
        metrics_server=metrics_server,
        otlp_exporter=otlp_exporter,
    )
    return worker.app, worker.detectors


class DetectWorker(Pipeline):
    """The Faust app of ``create_app`` and what its agent, timers and signal handlers share: one method
    each (registered on the app by ``_register``), the pipeline to the detector process (pipeline.py), the
    per-run budget, and the watch on the telemetry log's identity (log_guard.py)."""

    def __init__(
        self,
        bootstrap: str,
        config: RunwatchConfig,
        secret: bytes,
        *,
        app_id: str,
        web_port: int | None,
        web_host: str,
        ready_file: Path | None,
        detector_timeout_s: float,
        delivery_timeout_s: float,
        baseline_dsn: str | None,
        state: StateOptions | None,
        partitions: int | None,
        health_server: HealthServer | None,
        data_dir: Path | None,
        state_secret: bytes | None,
        metrics_server: MetricsServer | None = None,
        otlp_exporter: OtlpExporter | None = None,
    ):
        state = state or StateOptions()
        if state.enabled:  # (before anything starts: a missing or reused key is one error, at once)
            state_secret = resolve_state_secret(state_secret, action_secret=secret)
        self.app = app = faust_app(bootstrap, app_id, web_port or 6066, data_dir)
        self.telemetry = app.topic(topics.TELEMETRY, value_serializer="raw", key_serializer="raw")
        self.out_topics = {
            name: app.topic(name, value_serializer="raw", key_serializer="raw")
            for name in (topics.ANOMALIES, topics.ACTIONS, topics.DEADLETTER, topics.JOINED, topics.STATE)
        }
        # a split run's group reports, to its run key's worker
        self.out_topics[topics.TELEMETRY] = self.telemetry
        self.detectors = DetectorProcess(
            config,
            secret,
            reply_timeout_s=detector_timeout_s,
            baseline_dsn=baseline_dsn,
            state_bootstrap=bootstrap if state.enabled else None,
            state=state,
            group=app_id,
            partitions=partitions,
            state_secret=state_secret if state.enabled else None,
        )
        self.health = WorkerHealth(self.detectors)
        app.sensors.add(CommitSensor(self.health))
        runs = config.runs
        self.budget = RunBudget(
            BudgetLimits(
                runs.budget_events_per_s, runs.budget_burst_events, runs.new_runs_per_s, runs.new_runs_burst
            )
        )
        self.health.budget = self.budget
        self.ready_file = ready_file
        self.delivery_timeout_s = delivery_timeout_s
        # One pipeline, in request order: the agent's batches and the timer's ticks go to the detector
        # process, their records are published, and events are acknowledged once a checkpoint's records
        # (every run's state as of then: run_states.py) are delivered after them.
        self.inflight = None  # (None: the agent is not running)
        self.in_order = asyncio.Lock()
        self.submitted = {}  # telemetry partition -> the newest offset handed to the detector process
        # telemetry events taken from the consumer (transport.py) and not settled yet (acknowledged, or
        # dropped unsent): a revoke waits for none to be left
        self.unsettled = 0
        self.pipeline_ready = asyncio.Event()  # (the agent has started the pipeline: take hands events on)
        app.take_telemetry = self.take
        app.telemetry_settled = lambda: self.unsettled == 0
        # -- offsets that belong to the log they came from (log_identity.py)
        self.topic_ids = TopicIds(bootstrap)
        self.watch = LogWatch()
        self.id_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runwatch-topic-id")
        self.id_read_at = float("-inf")
        self.refusal_logged_at = float("-inf")
        self.shed_logged_at = float("-inf")
        if health_server is None and web_port is not None:
            health_server = HealthServer(web_host, web_port).start()
        self.health_server = health_server
        if health_server is not None:
            health_server.health = self.health
        self.metrics_server = metrics_server
        self.steps_asked_at = float("-inf")
        if metrics_server is not None:
            metrics_server.collector.health = self.health
        self.otlp_exporter = otlp_exporter
        if otlp_exporter is not None:
            otlp_exporter.watch(self.health)
        self.metrics_on = metrics_server is not None or otlp_exporter is not None
        self._register()

    def _register(self) -> None:
        """The agent, the timers and the signal handlers, on the app."""
        app = self.app
        app.agent(self.telemetry, name=f"{FAUST_NAMES}.detect")(self.detect)
        # mode's type of a signal receiver (*args, then a named ``signal``) is one no method matches under
        # mypy, hence the arg-type ignores on these connects
        app.on_partitions_assigned.connect(self.keep_owned_runs)  # type: ignore[arg-type]
        app.before_stop.append(self.last_checkpoint)
        app.timer(TICK_EVERY_S, name=f"{FAUST_NAMES}.tick")(self.tick)
        app.timer(0.5, name=f"{FAUST_NAMES}.recreated_logs")(self.check_log)
        app.timer(1.0, name=f"{FAUST_NAMES}.report_shed")(self.report_shed)
        # (what was shed since the last report is said before stopping)
        app.before_stop.append(self.report_shed)
        app.timer(30.0, name=f"{FAUST_NAMES}.report_counters")(self.report_counters)
        if self.health_server is not None or self.metrics_on:
            app.on_before_shutdown.connect(self.stop_health)  # type: ignore[arg-type]
        app.on_before_shutdown.connect(self.stop_detectors)  # type: ignore[arg-type]

    async def keep_owned_runs(self, sender: Any, assigned: set[TP], **kwargs: Any) -> None:
        """Partitions assigned: the detector process keeps their runs and restores those new to it."""
        owned = {tp.partition for tp in assigned if tp.topic == topics.TELEMETRY}
        self.budget.forget()  # (Faust seeks every partition to its committed offset: the log is watched anew)
        for partition in set(self.submitted) - owned:
            del self.submitted[partition]
        health = self.health
        # Not ready until the runs of these partitions are restored (the child reports its progress only
        # once it has started)
        health.restoring = sorted(owned)
        health.partitions = sorted(f"{tp.topic}:{tp.partition}" for tp in assigned)
        # The telemetry topic's id: snapshots of another log are not restored as they are (a changed id
        # makes the worker read the partitions again from their beginning once the rebalance is over)
        current = await self.read_log_id(ID_EVERY_S)
        log_id = current if isinstance(current, str) else None
        # Drops the runs moved away and restores those of new partitions (before any of their events:
        # the child handles requests in order). The reply also says the detector process is up: only
        # then is the worker ready.
        try:
            reply = await self.detectors.submit("keep_partitions", (owned, log_id))
            if self.watch.id_changed(current):  # (a broker that lost its data: the group is new too)
                was = self.watch.known_id
                await self.start_over(owned, current, f"a new topic id {current}, was {was}", assigned)
        except DetectorProcessError as exc:
            await self.fail(str(exc).splitlines()[0], exc)
        health.restoring = None
        for run in reply.dropped_runs:
            log.info("run %s moved to another worker", run)
        if self.ready_file is not None:
            write_ready_file(self.ready_file, assigned)

    async def last_checkpoint(self) -> None:
        # Stopping: every run's state now, so that what this worker read is acknowledged and committed
        # (Faust waits for that) and its successor starts where it stopped.
        if self.inflight is None or self.detectors.failed:
            return
        done = asyncio.get_running_loop().create_future()
        await self.submit("tick", (True, []), None, done)
        await asyncio.wait_for(done, self.delivery_timeout_s)

    async def tick(self) -> None:  # as `runwatch replay --tick` does on event time
        # Stalled or silent ranks are found by time passing, not by an event arriving; not for runs
        # whose partition this worker is behind on. During a rebalance the tick asks for a checkpoint
        # at once: the revoke waits for every event's ack.
        if self.inflight is not None:
            # the runs' last step times, for the metrics: at most once a second
            now = time.monotonic()
            want_steps = self.metrics_on and now - self.steps_asked_at >= STEP_TIMES_EVERY_S
            if want_steps:
                self.steps_asked_at = now
            await self.submit("tick", (bool(self.app.rebalancing), self.behind(), want_steps), None)

    async def report_shed(self) -> None:
        # Events shed over a run's budget (run_budget.py): a dead letter per run and partition, so that
        # the store and the dashboards show who was shed, and a log line at most every 10 s
        budget = self.budget
        report = budget.take_shed()
        if not report.events:
            return
        letters = shed_letters(report, budget.limits)
        await self.send(letters)
        self.health.shed_letters += len(letters)
        if time.monotonic() - self.shed_logged_at >= 10.0:
            self.shed_logged_at = time.monotonic()
            log.warning(
                "shed %d telemetry event(s) over their runs' budget (%s events/s, bursts of %d; %s new run "
                "ids/s): %s",
                report.events,
                f"{budget.limits.events_per_s:g}",
                budget.limits.burst_events,
                f"{budget.limits.new_runs_per_s:g}",
                ", ".join(
                    f"{key.decode(errors='replace')!r}[{partition}] {s.count}"
                    for (partition, key), s in list(report.runs.items())[:5]
                ),
            )

    async def report_counters(self) -> None:
        c = self.detectors.counters
        log.info(
            "processed=%d deadlettered=%d detector_errors=%d anomalies=%d actions=%s logs_recreated=%d",
            c.processed,
            c.deadlettered,
            c.detector_errors,
            c.anomalies,
            dict(c.actions),
            c.logs_recreated,
        )

    async def stop_health(self, sender: Any, **kwargs: Any) -> None:
        if self.health.failure is not None:
            return  # a failing worker keeps saying why until the process ends
        if self.health_server is not None:
            self.health_server.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.otlp_exporter is not None:
            self.otlp_exporter.close()  # (a last export: this worker's final counts)

    async def stop_detectors(self, sender: Any, **kwargs: Any) -> None:
        self.detectors.close()
        self.topic_ids.close()
        self.id_reader.shutdown(wait=False)


def shed_letters(report: ShedReport, limits: BudgetLimits) -> list[Outgoing]:
    """Dead letters (stage ``budget``) for what ``report`` says was shed, one per run and partition."""
    letters = []
    for (partition, key), shed in report.runs.items():
        why = (
            f"a new run id beyond the partition's {limits.new_runs_per_s:g} new run ids/s"
            if shed.reason == "new_run"
            else f"over the run's budget of {limits.events_per_s:g} events/s, bursts of {limits.burst_events}"
        )
        letter = DeadLetter.for_message(
            f"{shed.count} event(s) shed, offsets {shed.first_offset}-{shed.last_offset}: {why}",
            None,
            source_topic=topics.TELEMETRY,
            partition=partition,
            offset=shed.first_offset,
            key=key,
            stage="budget",
        )
        letters.append(Outgoing(topics.DEADLETTER, key or None, letter.to_json(), None))
    if report.other_events:
        letter = DeadLetter.for_message(
            f"{report.other_events} event(s) of more runs shed (runs past the first {len(report.runs)} "
            "of this report are not named)",
            None,
            source_topic=topics.TELEMETRY,
            stage="budget",
        )
        letters.append(Outgoing(topics.DEADLETTER, None, letter.to_json(), None))
    return letters


def run_worker(app: faust.App, loglevel: str = "WARNING") -> None:
    """Run until SIGINT/SIGTERM (blocks; Faust installs the signal handlers)."""
    from faust.worker import Worker

    logging.getLogger("runwatch").setLevel(logging.INFO)
    Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
