"""The Faust application: consumes telemetry as raw bytes, has the detector process run the
processor on it (worker/runwatch/worker/detector_process.py), and publishes the results.

Built by ``create_app`` (not at import time) so that the bootstrap, config and secret
come from the command line. ``run_worker`` starts it in this process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import faust

from runwatch.contract import topics
from runwatch.contract.schema import DeadLetter
from runwatch.detectors import RunwatchConfig
from runwatch.detectors.offline.replay import TICK_EVERY_S
from runwatch.worker import transport
from runwatch.worker.detector_process import (
    REPLY_TIMEOUT_S,
    DetectorProcess,
    DetectorProcessError,
    Outgoing,
    RawEvent,
    Reply,
)
from runwatch.worker.health import CommitSensor, WorkerHealth
from runwatch.worker.health_server import HealthServer
from runwatch.worker.log_identity import (
    ID_EVERY_S,
    UNKNOWN,
    LogWatch,
    TopicIds,
    commit_offsets_allowed,
)
from runwatch.worker.run_budget import BudgetLimits, RunBudget, ShedReport
from runwatch.worker.state.run_states import StateOptions
from runwatch.worker.state.snapshot import resolve_state_secret

if TYPE_CHECKING:
    from faust.types import TP, RecordMetadata, StreamT

    from runwatch.worker.metrics_server import MetricsServer
    from runwatch.worker.otlp_export import OtlpExporter

    # What the pipeline's two queues hold, per request: the offsets of its events (None: the timer's),
    # its reply to come (then its records' deliveries, whether it is a checkpoint and its findings' event
    # times), the future it resolves.
    _Events: TypeAlias = list[transport.Settlement]
    _Inflight: TypeAlias = tuple[_Events | None, Awaitable[Reply], asyncio.Future[bool] | None]
    _Delivered: TypeAlias = tuple[
        _Events | None, list[Awaitable[RecordMetadata]], bool, asyncio.Future[bool] | None, list[float]
    ]

log = logging.getLogger(__name__)

DETECT_GROUP = topics.DETECT_GROUP
# Events go to the detector process as they were fetched, in requests of up to this many: a backlog fills
# them at once, and a quiet run's event goes alone, with no wait for others (transport.py takes them).
BATCH_MAX_EVENTS = 500
# batches sent to the detector process and not yet answered (a few, so it never idles)
MAX_BATCHES_IN_FLIGHT = 6


def faust_broker_url(bootstrap: str) -> str:
    # runwatch:// is Faust's Kafka transport with a short fetch wait
    # (worker/runwatch/worker/transport.py)
    return ";".join(f"{transport.SCHEME}://{hp.strip()}" for hp in bootstrap.split(",") if hp.strip())


class RunwatchApp(faust.App):
    """Faust's app with hooks run first thing when it stops, while its agents and timers still run
    (Faust waits for every read event's acknowledgement before its ``on_before_shutdown``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.before_stop: list[Callable[[], Awaitable[None]]] = []
        # Set by the worker: the telemetry records as fetched go to it, not to Faust's streams, and a revoke
        # waits until what it took is settled (transport.py)
        self.take_telemetry: Callable[[list[transport.Taken]], Awaitable[None]] | None = None
        self.telemetry_settled: Callable[[], bool] | None = None

    async def on_stop(self) -> None:
        for hook in self.before_stop:
            try:
                await hook()
            except Exception:  # stopping goes on; what was not acknowledged is read again
                log.exception("a stop hook failed")
        await super().on_stop()


def faust_app(bootstrap: str, app_id: str, web_port: int = 6066, data_dir: Path | None = None) -> RunwatchApp:
    """A Faust app with runwatch's settings (raw bytes, short fetch wait, quick group joins). ``data_dir``:
    Faust's own folder (default Faust's, ``<app_id>-data`` in the working directory)."""
    extra = {"datadir": str(data_dir)} if data_dir is not None else {}
    return RunwatchApp(
        app_id,
        **extra,
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
        producer_max_request_size=topics.STATE_MAX_BYTES + (1 << 20),  # a run's snapshot is one record
        web_enabled=False,
        web_port=web_port,
    )


def write_ready_file(ready_file: Path, assigned: Iterable[TP]) -> None:
    ready_file.write_text(",".join(sorted(f"{tp.topic}:{tp.partition}" for tp in assigned)))


STEP_TIMES_EVERY_S = 1.0  # with metrics on, a tick asks for the runs' last step times at most this often
MAX_BATCHES_AWAITING_DELIVERY = 64  # batches whose records are sent, waiting for the broker's acknowledgement
DELIVERY_TIMEOUT_S = 60.0  # the producer retries within this; a record still undelivered fails the worker


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


class DetectWorker:
    """The Faust app of ``create_app`` and what its agent, timers and signal handlers share: one method
    each (registered on the app by ``_register``), the pipeline to the detector process, the per-run
    budget, and the watch on the telemetry log's identity."""

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
        self.out_topics[topics.TELEMETRY] = (
            self.telemetry
        )  # a split run's group reports, to its run key's worker
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
        self.inflight: asyncio.Queue[_Inflight] | None = None  # (None: the agent is not running)
        self.in_order = asyncio.Lock()
        self.submitted: dict[
            int, int
        ] = {}  # telemetry partition -> the newest offset handed to the detector process
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
        app.agent(self.telemetry, name=f"{__name__}.detect")(self.detect)
        # mode's type of a signal receiver (*args, then a named ``signal``) is one no method matches under
        # mypy, hence the arg-type ignores on these connects
        app.on_partitions_assigned.connect(self.keep_owned_runs)  # type: ignore[arg-type]
        app.before_stop.append(self.last_checkpoint)
        app.timer(TICK_EVERY_S, name=f"{__name__}.tick")(self.tick)
        app.timer(0.5, name=f"{__name__}.recreated_logs")(self.check_log)
        app.timer(1.0, name=f"{__name__}.report_shed")(self.report_shed)
        app.before_stop.append(
            self.report_shed
        )  # (what was shed since the last report is said before stopping)
        app.timer(30.0, name=f"{__name__}.report_counters")(self.report_counters)
        if self.health_server is not None or self.metrics_on:
            app.on_before_shutdown.connect(self.stop_health)  # type: ignore[arg-type]
        app.on_before_shutdown.connect(self.stop_detectors)  # type: ignore[arg-type]

    async def fail(self, reason: str, exc: BaseException) -> None:
        self.health.fail(reason)
        await self.app.crash(exc)
        raise exc

    async def send(self, records: list[Outgoing]) -> list[Awaitable[RecordMetadata]]:
        """Hand the records to the producer in order; returns their delivery futures."""
        try:
            return [
                await self.out_topics[r.topic].send(key=r.key, value=r.value, partition=r.partition)
                for r in records
            ]
        except Exception as exc:  # refused before sending (e.g. too large): never acked
            self.health.publish_failures += 1
            await self.fail(
                f"cannot publish results ({len(records)} records): {exc!r}; their events stay uncommitted",
                exc,
            )
            raise

    def behind(self) -> list[int]:
        """Telemetry partitions whose broker holds events this worker has not handed on yet."""
        lagging = []
        submitted, budget = self.submitted, self.budget
        for tp in self.app.consumer.assignment():
            if tp.topic != topics.TELEMETRY or tp.partition not in submitted:
                continue  # (nothing read from it yet: unknown, judged as caught up)
            try:
                high = self.app.consumer.highwater(tp)
            except Exception:  # noqa: BLE001 - no fetch answered yet
                continue
            if high is not None and high - 1 > submitted[tp.partition]:
                if budget.caught_up(tp.partition, submitted[tp.partition]) and (
                    budget.read_through(tp.partition) >= high - 1
                ):
                    continue  # (what follows the last event handed on was shed: run_budget.py)
                lagging.append(tp.partition)
        return lagging

    async def submit(
        self, kind: str, payload: Any, batch: list[Any] | None, done: asyncio.Future[bool] | None = None
    ) -> None:
        """``done`` resolves once this request's records are delivered and, at a checkpoint, acknowledged."""
        async with self.in_order:  # (the child answers in request order: the queue must hold that order too)
            assert self.inflight is not None  # (only while the agent runs)
            await self.inflight.put((batch, self.detectors.submit(kind, payload), done))

    # -- offsets that belong to the log they came from (log_identity.py) ---------------------------

    def telemetry_consumer(self) -> transport.Consumer:
        return cast(transport.Consumer, self.app.consumer)

    def high_watermark(self, tp: TP) -> int | None:
        try:
            return cast(int | None, self.app.consumer.highwater(tp))
        except Exception:  # noqa: BLE001 - not fetched yet, or no longer assigned
            return None

    async def read_log_id(self, timeout_s: float) -> object:
        """The telemetry topic's id now (None: the broker reports none; UNKNOWN: it did not answer)."""
        try:
            current = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self.id_reader, self.topic_ids.read), timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - judged by the high watermark alone this time
            log.debug("the %s topic id could not be read: %r", topics.TELEMETRY, exc)
            return UNKNOWN
        self.id_read_at = time.monotonic()
        self.health.log_id = current
        return current

    async def guard_commit(self, offsets: Mapping[TP, int]) -> Mapping[TP, int]:
        """Never commit an old log's position on a new one: telemetry offsets are committed only while
        the topic id is the one they were read under and within their log's end."""
        telemetry = {tp: o for tp, o in offsets.items() if tp.topic == topics.TELEMETRY}
        if not telemetry:
            return offsets
        changed = self.watch.id_changed(await self.read_log_id(2.0))
        allowed, refused = commit_offsets_allowed(telemetry, self.high_watermark, changed)
        if refused:
            self.health.commits_refused += len(refused)
            if time.monotonic() - self.refusal_logged_at >= 10.0:
                self.refusal_logged_at = time.monotonic()
                log.warning(
                    "not committed (an old log's position on a new log): %s",
                    "; ".join(
                        f"{tp.topic}[{tp.partition}]@{offsets[tp]}: {why}" for tp, why in refused.items()
                    ),
                )
        return {**{tp: o for tp, o in offsets.items() if tp.topic != topics.TELEMETRY}, **allowed}

    async def start_over(
        self, partitions: set[int], current: object, why: str, assigned: Iterable[TP] | None = None
    ) -> None:
        """Forget the old log's positions of ``partitions`` here and in the detector process (its runs'
        offsets), and read them again from the beginning of their new log. ``assigned``: at an assignment
        (Faust seeks them to their committed offsets next, which are never an old log's: guard_commit)."""
        consumer = self.telemetry_consumer()
        tps = sorted(
            tp
            for tp in (consumer.assignment() if assigned is None else assigned)
            if tp.topic == topics.TELEMETRY and tp.partition in partitions
        )
        if not tps:
            return
        beginnings: Mapping[TP, int] = {}
        if assigned is None:
            try:
                beginnings = await consumer.earliest_offsets(*tps)
            except Exception:  # noqa: BLE001 - a new log begins at 0
                beginnings = {}
        self.budget.forget({tp.partition for tp in tps})
        for tp in tps:
            unsettled = consumer.forget_positions(tp)
            self.submitted.pop(tp.partition, None)
            start = beginnings.get(tp) or 0
            if assigned is None:
                await consumer.seek(tp, start)
            log.warning(
                "%s[%d] was recreated (%s): read again from %s; the old log's positions are forgotten and "
                "never committed on the new one (%d event(s) of it read and not committed); its runs' "
                "offsets are forgotten",
                tp.topic,
                tp.partition,
                why,
                f"offset {start}" if assigned is None else "its committed offset (or its beginning)",
                unsettled,
            )
        self.watch.recreated({tp.partition for tp in tps}, current)
        log_id = current if isinstance(current, str) else None
        reply = await self.detectors.submit("log_recreated", ({tp.partition for tp in tps}, log_id))
        for run in reply.dropped_runs:
            log.info(
                "run %s: its snapshot was of the old log: it starts fresh with its checkpoint ledger", run
            )

    async def check_log(self) -> None:
        """A recreated telemetry log: a new topic id, or a log that ends below what was read from it."""
        consumer = self.telemetry_consumer()
        if self.inflight is None or self.app.rebalancing or not consumer.flow_active:
            return  # (a rebalance sets the positions: judged once it is over)
        current = UNKNOWN
        if time.monotonic() - self.id_read_at >= ID_EVERY_S:
            current = await self.read_log_id(ID_EVERY_S)
        owned = {tp: tp.partition for tp in consumer.assignment() if tp.topic == topics.TELEMETRY}
        if self.watch.id_changed(current):
            was = self.watch.known_id
            await self.start_over(set(owned.values()), current, f"a new topic id {current}, was {was}")
            return
        for tp, partition in owned.items():
            read = consumer.read_offset(tp)
            position = max(read if read is not None else -1, self.submitted.get(partition, -1) + 1)
            high = self.high_watermark(tp)
            if self.watch.ends_below(partition, high, position if position >= 0 else None):
                await self.start_over(
                    {partition}, current, f"its log ends at {high}, below offset {position}"
                )

    # -- the pipeline --------------------------------------------------------------------------------

    async def acknowledge(self, delivered: asyncio.Queue[_Delivered]) -> None:
        # A batch's events are acknowledged (so their offsets may be committed) only once the broker has
        # acknowledged every record they produced, and a checkpoint after them. The producer retries
        # transient errors itself; what still fails fails the worker, and the events are read again by
        # its successor.
        held: list[transport.Settlement] = []
        consumer = self.telemetry_consumer()
        while True:
            batch, futures, checkpoint, done, finding_times = await delivered.get()
            try:
                if futures:
                    await asyncio.wait_for(asyncio.gather(*futures), self.delivery_timeout_s)
            except Exception as exc:  # noqa: BLE001 - fail() fails the worker and raises it again
                self.health.publish_failures += 1
                events = sum(len(s.offsets) for s in batch or ())
                what = f"results of {events} events" if batch else "timer findings and snapshots"
                await self.fail(
                    f"{what} were not delivered: {exc!r}; the events they cover stay uncommitted", exc
                )
            if finding_times:  # (published: the detection latency of each, once per finding)
                self.health.latency.observe_since(finding_times, time.time())
            if batch:
                held.extend(batch)
            if checkpoint:
                consumer.settle(held)
                self.unsettled -= sum(len(s.offsets) for s in held)
                held.clear()
                self.health.last_ack = time.monotonic()
            if done is not None and not done.done():
                done.set_result(checkpoint)

    async def complete(
        self, inflight: asyncio.Queue[_Inflight], delivered: asyncio.Queue[_Delivered]
    ) -> None:
        # In order: send a request's records, then hand them to the acknowledger, while the next runs.
        while True:
            batch, reply, done = await inflight.get()
            # (a request's findings go out first, while the child snapshots their runs)
            futures = await self.send(await self.detectors.findings(reply))
            try:
                answer = await reply
            except DetectorProcessError as exc:
                await self.fail(str(exc).splitlines()[0], exc)
            futures += await self.send(answer.records)
            await delivered.put((batch, futures, answer.checkpoint, done, answer.finding_times))

    async def detect(self, stream: StreamT[Any]) -> None:
        """The agent: subscribes the app to telemetry and runs the pipeline to the detector process, which
        ``take`` feeds with the records as the consumer fetches them (Faust's streams never see them)."""
        inflight: asyncio.Queue[_Inflight] = asyncio.Queue(maxsize=MAX_BATCHES_IN_FLIGHT)
        delivered: asyncio.Queue[_Delivered] = asyncio.Queue(maxsize=MAX_BATCHES_AWAITING_DELIVERY)
        completer = asyncio.ensure_future(self.complete(inflight, delivered))
        acknowledger = asyncio.ensure_future(self.acknowledge(delivered))
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.detectors.wait_ready)
            self.inflight = inflight
            self.telemetry_consumer().commit_guard = self.guard_commit
            self.telemetry_consumer().run_budget = self.budget
            self.pipeline_ready.set()
            finished, _ = await asyncio.wait((completer, acknowledger), return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()  # the detector process or publishing failed: crash with its error
        finally:
            self.pipeline_ready.clear()
            self.inflight = None
            completer.cancel()
            acknowledger.cancel()

    async def take(self, taken: list[transport.Taken]) -> None:
        """Telemetry records as fetched (transport.py), to the detector process in requests of at most
        ``BATCH_MAX_EVENTS``, in offset order per partition. Called by the consumer's fetch loop, which waits
        for it: a full pipeline holds the next fetch back. Records of a log found recreated meanwhile
        (start_over) are dropped unsent."""
        items = [(t.tp, t.epoch, record) for t in taken for record in t.records]
        self.unsettled += len(items)  # (counted at once: a revoke from now on waits for them)
        sent = 0
        try:
            if not self.pipeline_ready.is_set():
                await self.pipeline_ready.wait()
            consumer = self.telemetry_consumer()
            submitted, health = self.submitted, self.health
            for start in range(0, len(items), BATCH_MAX_EVENTS):
                chunk = items[start : start + BATCH_MAX_EVENTS]
                raw: list[RawEvent] = []
                offsets: dict[tuple[Any, int], list[int]] = {}
                for tp, epoch, record in chunk:
                    if consumer.epoch(tp) != epoch:
                        continue  # (its log was recreated while this waited: read again from its start)
                    timestamp = record.timestamp
                    raw.append(
                        (
                            record.value,
                            record.key,
                            record.partition,
                            record.offset,
                            None if timestamp is None else timestamp / 1000.0,
                        )
                    )
                    offsets.setdefault((tp, epoch), []).append(record.offset)
                    submitted[record.partition] = record.offset  # (the newest: after a seek back, lower)
                dropped = len(chunk) - len(raw)
                if raw:
                    settlements = [transport.Settlement(tp, e, o) for (tp, e), o in offsets.items()]
                    await self.submit("events", raw, settlements)
                    health.events_submitted += len(raw)
                sent += len(chunk)
                self.unsettled -= dropped
        finally:
            self.unsettled -= len(items) - sent  # (not sent: cancelled, or the pipeline stopped)

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
