"""The worker's detectors in a child process, so that Kafka I/O and detection use two cores.

Faust's consumer, the event loop and the detectors would otherwise share one interpreter lock:
every microsecond of detector work was a microsecond the worker could not fetch. Here the
``TelemetryProcessor`` lives in a spawned child; the worker sends it batches of raw events
and gets back the records to publish, already serialised. Requests are answered in the
order they were sent (one queue each way), so a caller matches replies to requests by
position, and a run's events are processed in offset order.

The child exits when asked, when its parent process goes away, or on the first error; the
parent then fails every pending request with ``DetectorProcessError`` (the worker crashes
and its unacknowledged events are read again by its successor: nothing is lost).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from runwatch.contract import logsafe, topics
from runwatch.detectors import RunwatchConfig
from runwatch.worker.processor import ProcessResult, StateRecord, TelemetryProcessor, WorkerCounters
from runwatch.worker.state.run_states import StateOptions

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often each side checks that the other is still there
# After a request's findings are handed over, a pause for the reply queue's feeder thread to pickle and write
# them before the snapshots are encoded: otherwise it waits for the GIL until they are (measured: 4.3 ms after
# the put for 4 ms of pickling, with or without a shorter switch interval; 0.2 ms with this pause)
FINDINGS_HANDOVER_S = 0.0005
_START_TIMEOUT_S = 120.0
# A request unanswered this long means the child is frozen or stuck (a batch of 500 events takes
# tens of milliseconds): it is killed and the worker fails, so a supervisor restarts it.
REPLY_TIMEOUT_S = 30.0


class DetectorProcessError(RuntimeError):
    """The detector process failed or exited; the message carries its traceback or exit code."""


@dataclass(frozen=True)
class Outgoing:
    """One record for the worker to publish."""

    topic: str
    key: bytes | None
    value: bytes | None  # None: a tombstone (runwatch.state only)
    partition: int | None = None  # None: by key; state records go to their run's telemetry partition number


@dataclass
class Reply:
    records: list[Outgoing] = field(default_factory=list)
    counters: WorkerCounters = field(default_factory=WorkerCounters)
    # `keep_partitions`: the runs moved away; `log_recreated`: those whose snapshot was stale
    dropped_runs: list[str] = field(default_factory=list)
    # Every event handled before this reply is in a snapshot once its records are delivered (run_states.py):
    # only then may those events be acknowledged.
    checkpoint: bool = True
    # The event time (seconds since the epoch) of each finding among ``records``: the worker observes its
    # detection latency once they are delivered (metrics_server.py)
    finding_times: list[float] = field(default_factory=list)
    # run id -> rank -> its last step's event time (step_times.py): on a tick that asked for them
    step_times: dict[str, dict[int, float]] | None = None


RawEvent = tuple[
    bytes | None, bytes | None, int | None, int | None, float | None
]  # value, key, partition, offset, timestamp


def outgoing(result: ProcessResult, key: bytes | None = None) -> list[Outgoing]:
    """A processing result as the records to publish: the dead letter, anomalies, actions, joined steps."""
    records = []
    if result.deadletter is not None:
        records.append(Outgoing(topics.DEADLETTER, key, result.deadletter.to_json()))
    records.extend(Outgoing(topics.DEADLETTER, (d.key or "").encode(), d.to_json()) for d in result.errors)
    records.extend(Outgoing(topics.ANOMALIES, a.run_id.encode(), a.to_json()) for a in result.anomalies)
    records.extend(Outgoing(topics.ACTIONS, a.run_id.encode(), a.to_json()) for a in result.actions)
    records.extend(Outgoing(topics.JOINED, s.run_id.encode(), s.to_json()) for s in result.joined)
    # a split run's groups report to the worker of the run's own key (split_runs.py)
    records.extend(Outgoing(topics.TELEMETRY, r.run_id.encode(), r.to_json()) for r in result.reports)
    return records


def state_outgoing(records: list[StateRecord]) -> list[Outgoing]:
    return [Outgoing(topics.STATE, r.key.encode(), r.value, r.partition) for r in records]


RELEASE_EVERY_S = 5.0  # at most this often, freed memory is given back after runs were let go


# When freed memory was last given back, and how many runs had been let go by then (one detector
# process per interpreter)
_released: dict[str, float] = {"at": 0.0, "let_go": 0}


def release_memory() -> None:
    """Give freed memory back to the system: a collection, then glibc's ``malloc_trim`` (elsewhere a no-op).
    Without it the allocator keeps the pages of thousands of runs let go, and the process never shrinks."""
    import ctypes
    import ctypes.util
    import gc

    before = _rss_mib()
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc
    log.info("runs were let go: memory given back, resident %.0f -> %.0f MiB", before, _rss_mib())


def _rss_mib() -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")  # not Linux


def handle(
    processor: TelemetryProcessor,
    kind: str,
    payload: Any,
    findings: Callable[[list[Outgoing]], None] | None = None,
) -> Reply:
    """One request, as the child runs it (also usable in-process, e.g. by tests). ``findings``: given the
    records of an events request's findings before its snapshots are taken (they are then not in the
    reply): the worker publishes them while the snapshots are encoded."""
    reply = Reply()
    rebalancing = False
    if kind == "events":
        for raw, key, partition, offset, timestamp in payload:
            result = processor.process(raw, key, partition, offset, timestamp)
            if result.deadletter is not None:
                log.warning(
                    "dead letter at %s[%s]@%s: %s",
                    topics.TELEMETRY,
                    partition,
                    offset,
                    result.deadletter.reason[:300],
                )
            if (
                result.deadletter is not None
                or result.anomalies
                or result.actions
                or result.joined
                or result.errors
                or result.reports
            ):
                reply.records.extend(outgoing(result, key))
                reply.finding_times.extend(_latency_starts(result))
    # payload: (rebalancing: a checkpoint now, so the revoke is quick; partitions behind[; whether the
    # runs' last step times are wanted: the worker's metrics])
    elif kind == "tick":
        rebalancing, behind, want_steps = (
            (*payload, False)[:3] if isinstance(payload, tuple) else (bool(payload), (), False)
        )
        result = processor.tick(behind=frozenset(behind))
        reply.records = outgoing(result)
        reply.finding_times = _latency_starts(result)
        if want_steps:
            reply.step_times = processor.step_times.export()
        let_go = sum(processor.counters.runs_let_go.values())
        if let_go > _released["let_go"] and time.monotonic() - _released["at"] >= RELEASE_EVERY_S:
            _released.update(let_go=let_go, at=time.monotonic())
            release_memory()
    elif kind == "keep_partitions":  # payload: the partitions, or (them, the telemetry topic's id)
        partitions, log_id = payload if isinstance(payload, tuple) else (payload, None)
        reply.dropped_runs = processor.keep_partitions(partitions, log_id)
    elif kind == "log_recreated":  # payload: (partitions, the telemetry topic's id now)
        partitions, log_id = payload
        reply.dropped_runs = processor.log_recreated(partitions, log_id)
    else:
        raise ValueError(f"unknown request {kind!r}")
    if kind == "events" and findings is not None and reply.records:
        # (a run that emitted a finding is snapshotted at once, 1-3 ms of pickling, zlib and signing: its
        # findings need not wait for that; they are delivered before the events are acknowledged either way)
        findings(reply.records)
        reply.records = []
    if kind in ("events", "tick"):  # (the others are answered outside the pipeline that publishes)
        state, reply.checkpoint = processor.take_snapshots(force_checkpoint=kind == "tick" and rebalancing)
        reply.records.extend(state_outgoing(state))
    reply.counters = processor.counters
    return reply


def _serve(
    requests: Any,
    replies: Any,
    config_json: str,
    secret: bytes,
    parent_pid: int,
    baseline_dsn: str | None = None,
    state_bootstrap: str | None = None,
    state_json: str | None = None,
    group: str = topics.DETECT_GROUP,
    reply_timeout_s: float = REPLY_TIMEOUT_S,
    partitions: int | None = None,
    state_secret: bytes | None = None,
) -> None:
    """The child's loop: one request at a time, answered in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the worker, which closes us
    logging.basicConfig(
        level=logging.WARNING, format="[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s"
    )
    logsafe.install()
    logging.getLogger("runwatch").setLevel(logging.INFO)
    try:
        config = RunwatchConfig.model_validate_json(config_json)
        baselines = None
        if baseline_dsn:
            from runwatch.worker.baselines import BaselineLoader

            baselines = BaselineLoader(baseline_dsn, config)
        else:
            log.info(
                "no baseline DSN (--baseline-dsn): runs are not compared with their history (no "
                "baseline_trajectory band, no outlier check at their end)"
            )
        state = StateOptions.model_validate_json(state_json) if state_json else StateOptions(enabled=False)
        reader = None
        if state_bootstrap and state.enabled:
            from runwatch.worker.state.reader import StateReader

            # (a restore that reads nothing for this long fails, before the parent would take us for frozen;
            # one that reads goes on as long as it needs, and says so: RestoreProgress)
            reader = StateReader(state_bootstrap, timeout_s=max(5.0, reply_timeout_s - 5.0))
        processor = TelemetryProcessor(
            config,
            secret,
            baselines=baselines,
            state_reader=reader,
            state=state,
            group=group,
            partitions=partitions,
            state_secret=state_secret,
        )
        processor.on_restore_progress = lambda body: replies.put(("progress", body))
    except Exception:  # noqa: BLE001 - reported to the parent, which fails loudly
        replies.put(("error", traceback.format_exc()))
        return
    replies.put(("ready", None))

    def hand_over(found: list[Outgoing]) -> None:
        replies.put(("findings", found))
        time.sleep(FINDINGS_HANDOVER_S)

    while True:
        try:
            request = requests.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return  # the worker is gone (killed): nobody is left to answer
            continue
        if request is None:
            return
        try:
            kind, payload = request
            replies.put(("ok", handle(processor, kind, payload, hand_over)))
        except Exception:  # noqa: BLE001
            replies.put(("error", traceback.format_exc()))
            return


class DetectorProcess:
    """The parent's handle: ``submit`` returns a future for the reply; ``close`` stops the child."""

    def __init__(
        self,
        config: RunwatchConfig,
        secret: bytes,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
        baseline_dsn: str | None = None,
        state_bootstrap: str | None = None,
        state: StateOptions | None = None,
        group: str = topics.DETECT_GROUP,
        partitions: int | None = None,
        state_secret: bytes | None = None,
    ):
        """``state_bootstrap``: the broker whose ``runwatch.state`` the runs' snapshots are read back
        from (None: no durable state); ``state``: when snapshots are taken; ``state_secret``: the workers'
        state key they are signed with (needed with durable state); ``partitions``: the telemetry
        topic's partition count (records on another partition than their key's are refused)."""
        self.reply_timeout_s = reply_timeout_s
        ctx = multiprocessing.get_context("spawn")  # (fork is unsafe once Faust's threads run)
        self._requests = ctx.Queue()
        self._replies = ctx.Queue()
        self._process = ctx.Process(
            target=_serve,
            name="runwatch-detectors",
            daemon=True,
            args=(
                self._requests,
                self._replies,
                config.model_dump_json(),
                secret,
                os.getpid(),
                baseline_dsn,
                state_bootstrap,
                (state or StateOptions()).model_dump_json(),
                group,
                reply_timeout_s,
                partitions,
                state_secret,
            ),
        )
        self._pending: deque[asyncio.Future[Reply]] = deque()
        # per pending request, an events request's findings, answered ahead of its reply (``findings``)
        self._findings: deque[asyncio.Future[list[Outgoing]] | None] = deque()
        self._findings_of: dict[object, asyncio.Future[list[Outgoing]]] = {}  # (by the reply's future)
        self._sent_at: deque[float] = deque()  # monotonic send time of each pending request
        self._last_reply = time.monotonic()
        self._last_progress = 0.0  # monotonic time of the child's latest progress report (a long restore)
        self.restore_progress: dict[str, Any] | None = None  # the latest one
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._failure: DetectorProcessError | None = None
        self._closing = False
        self.counters = WorkerCounters()  # as of the latest reply
        # run id -> rank -> last step's event time, as of the latest tick that asked (the metrics)
        self.step_times: dict[str, dict[int, float]] = {}
        # One malloc arena in the child (glibc reads this when a process starts): the replies its queue
        # thread pickles otherwise fill arenas of their own, which keep their pages after runs are let go
        # (a flood of 10,000 runs: +62 MiB left after they went, against +75 to +85 MiB with glibc's default).
        before = os.environ.get("MALLOC_ARENA_MAX")
        os.environ.setdefault("MALLOC_ARENA_MAX", "1")
        try:
            self._process.start()
        finally:
            if before is None:
                os.environ.pop("MALLOC_ARENA_MAX", None)
        self._reader = threading.Thread(target=self._read, name="runwatch-detector-replies", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def wait_ready(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Block until the child has built its processor (it imports the detectors: a second or two)."""
        if not self._ready.wait(timeout):
            raise DetectorProcessError(f"the detector process did not start within {timeout} s")
        if self._failure is not None:
            raise self._failure

    def submit(self, kind: str, payload: Any = None) -> asyncio.Future[Reply]:
        """Send a request (from the event loop); the future resolves to its ``Reply``."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        future = loop.create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
            return future
        self._pending.append(future)
        early = loop.create_future() if kind == "events" else None
        self._findings.append(early)
        if early is not None:
            self._findings_of[future] = early
        self._sent_at.append(time.monotonic())
        self._requests.put((kind, payload))
        return future

    async def findings(self, reply: Awaitable[Reply]) -> list[Outgoing]:
        """The records of an events request's findings (``reply`` is what ``submit`` returned), as soon as
        the child has them, before its snapshots and reply: [] for another request, or one without
        findings (then once it is answered). Called once per request, in request order."""
        early = self._findings_of.pop(reply, None)
        return [] if early is None else await early

    def oldest_pending_s(self) -> float:
        """How long the oldest unanswered request has waited (0 when none is pending)."""
        try:
            return max(0.0, time.monotonic() - self._sent_at[0])
        except IndexError:
            return 0.0

    def stalled_s(self) -> float:
        """How long the child has neither answered the oldest request nor reported progress on it (0 when
        nothing is pending): a restore that goes on for minutes while it reports progress is not stalled."""
        try:
            since = max(self._sent_at[0], self._last_progress)
        except IndexError:
            return 0.0
        return max(0.0, time.monotonic() - since)

    def health(self) -> dict[str, Any]:
        """For the worker's health endpoint."""
        progress = None
        if self.restore_progress is not None:
            progress = {**self.restore_progress, "age_s": round(time.monotonic() - self._last_progress, 3)}
        return {
            "alive": self._process.is_alive() and self._failure is None,
            "pid": self._process.pid,
            "ready": self._ready.is_set() and self._failure is None,
            "pending_requests": len(self._sent_at),
            "oldest_pending_s": round(self.oldest_pending_s(), 3),
            "stalled_s": round(self.stalled_s(), 3),
            "restore": progress,
            "last_reply_age_s": round(time.monotonic() - self._last_reply, 3),
            "failure": str(self._failure).splitlines()[0] if self._failure is not None else None,
        }

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to finish its current request and exit; kill it if it does not."""
        self._closing = True
        if self._process.is_alive():
            self._requests.put(None)
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(5)
        self._fail(DetectorProcessError("the detector process was closed"))

    # -- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                status, body = self._replies.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._process.is_alive():
                    code = self._process.exitcode
                    self._fail(DetectorProcessError(f"the detector process exited with code {code}"))
                    return
                waited = self.stalled_s()
                if waited > self.reply_timeout_s:
                    self._fail(
                        DetectorProcessError(
                            f"the detector process (pid {self._process.pid}) has neither answered nor "
                            f"reported progress for {waited:.0f} s (limit {self.reply_timeout_s:.0f} s): "
                            "frozen or stuck; it was killed"
                        )
                    )
                    self._process.kill()
                    return
                continue
            except (EOFError, OSError):
                self._fail(DetectorProcessError("the detector process's reply queue closed"))
                return
            if status == "ready":
                self._ready.set()
            elif status == "progress":  # a long request (a restore) going on: not frozen
                self.restore_progress, self._last_progress = body, time.monotonic()
            elif status == "findings":
                self._resolve_findings(body)
            elif status == "ok":
                self._resolve(body)
            else:
                self._fail(DetectorProcessError(f"the detector process failed:\n{body}"))
                return

    def _resolve(self, reply: Reply) -> None:
        def resolve() -> None:
            self.counters = reply.counters
            if reply.step_times is not None:
                self.step_times = reply.step_times
            self._last_reply = time.monotonic()
            self._sent_at.popleft()
            future = self._pending.popleft()
            early = self._findings.popleft()
            if early is not None and not early.done():
                early.set_result([])
            if not future.done():
                future.set_result(reply)

        self._call_in_loop(resolve)

    def _resolve_findings(self, records: list[Outgoing]) -> None:
        def resolve() -> None:
            early = self._findings[0] if self._findings else None  # (the request being answered: the oldest)
            if early is not None and not early.done():
                early.set_result(records)

        self._call_in_loop(resolve)

    def _fail(self, error: DetectorProcessError) -> None:
        if self._failure is None:
            self._failure = error
            if not self._closing:
                log.error("%s", error)
        self._ready.set()

        def fail_pending() -> None:
            self._sent_at.clear()
            while self._findings:
                early = self._findings.popleft()
                if early is not None and not early.done():
                    early.set_result([])  # (their reply fails: the worker fails)
            self._findings_of.clear()
            while self._pending:
                future = self._pending.popleft()
                if not future.done():
                    future.set_exception(error)

        self._call_in_loop(fail_pending)

    def _call_in_loop(self, fn: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:
            pass  # the loop closed meanwhile: nobody is waiting any more


def _latency_starts(result: ProcessResult) -> list[float]:
    """Where each finding's detection latency starts: the arrival of the record it came of, or for a
    tick's, the moment the worker produced it (``detected_at``; its event time may be hours old)."""
    out = []
    for a in result.anomalies:
        made = a.detected_at or a.ts
        start = result.received_at
        # a record time more than PLAUSIBLE_LATENCY before the finding is a producer's own clock (a
        # simulated run stamps its records with it) or a backlog: then the worker's part, from the finding
        if start is None or (made - start).total_seconds() > PLAUSIBLE_LATENCY_S:
            start = made
        out.append(start.timestamp())
    return out


PLAUSIBLE_LATENCY_S = 300.0  # the histogram's largest bucket
