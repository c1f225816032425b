"""``runwatch demo``: the whole loop on one machine.

Starts what is missing (embedded broker, a Faust worker process, the ClickHouse sink
in this process, since an embedded chdb path belongs to one process), trains a real
model with a catalog scenario's fault, takes the actions, waits until every published
event is stored, shuts everything down and reports what happened, read back from ClickHouse.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runwatch.contract import topics
from runwatch.contract.signing import (
    ActionPublicKeys,
    ActionSigningKey,
    MissingKeyError,
    resolve_public_keys,
    resolve_signing_key,
)
from runwatch.demo.training import TrainingConfig, default_fault_step, train
from runwatch.local.broker import EmbeddedBroker, committed_offset, ensure_topics, free_port
from runwatch.local.netcut import NetCut
from runwatch.local.worker_process import WorkerProcess, wait_until
from runwatch.producer import ActionListener, AppliedAction, RunWatch
from runwatch.scenarios.catalog import SCENARIOS
from runwatch.scenarios.clocks import SimulatedClock
from runwatch.scenarios.live import TrainingResult
from runwatch.scenarios.scenario import Scenario
from runwatch.scenarios.training import run_scenario
from runwatch.sinks import ClickHouseSink, SinkConsumer
from runwatch.sinks.report import write_report
from runwatch.worker.app import DETECT_GROUP

if TYPE_CHECKING:
    from runwatch.producer import PublisherStats

STATE_DIR = Path(".runwatch")
REPORTS_DIR = STATE_DIR / "reports"


class DemoError(RuntimeError):
    pass


@dataclass
class DemoOptions:
    scenario: str = "nan"
    steps: int = 300
    fault_step: int | None = None
    bootstrap: str | None = None
    dsn: str | None = None
    config_path: Path | None = None
    start_worker: bool = True
    step_interval_s: float = 0.02
    timeout_s: float = 120.0
    # (start, end) as fractions of the run's steps: the broker is unreachable for every client
    # (trainer, worker, sink) in between. Needs the embedded broker.
    broker_outage: tuple[float, float] | None = None
    # A stall of stall_s seconds in the train phase at this step (the demo model only; None: none)
    stall_step: int | None = None
    stall_s: float = 15.0


def outage_steps(window: tuple[float, float], steps: int) -> tuple[int, int]:
    """The steps at which the network to the broker is cut and restored."""
    start, end = window
    if not 0.0 <= start < end <= 1.0:
        raise DemoError(f"broker outage window {start}:{end} must satisfy 0 <= start < end <= 1")
    cut_at = max(1, round(start * steps))
    return cut_at, max(cut_at + 1, round(end * steps))


def _run_recorded_scenario(
    sc: Scenario,
    rw: RunWatch,
    listener: ActionListener,
    step_interval_s: float,
    on_step: Callable[[int, float], None] | None,
    on_action: Callable[[AppliedAction], None],
) -> tuple[TrainingResult, int | None]:
    """One of `runwatch scenarios generate`'s real training runs, streamed live to the worker,
    whose actions it takes (a rollback restores the run's in-memory checkpoint).

    It runs on a simulated clock that starts now (a 3-minute hang takes no real time): the
    events carry simulated timestamps and the worker judges time on event time, as replay does.
    Steps are paced to ``step_interval_s`` of wall time, as the regressor's are, so that the
    worker's actions arrive while the run is still going.
    """
    sim = SimulatedClock(start=datetime.now(UTC))
    rw.clock = sim.now
    last = time.perf_counter()

    def paced(step: int, loss: float) -> None:
        nonlocal last
        wait = step_interval_s - (time.perf_counter() - last)
        if wait > 0:
            time.sleep(wait)
        last = time.perf_counter()
        if on_step is not None:
            on_step(step, loss)

    outcome = run_scenario(sc, rw, sim, on_step=paced, listener=listener, on_action=on_action)
    return outcome.live, outcome.onset_step


@dataclass
class _Outage:
    """The outage proxy between every client and the embedded broker, and the steps it is cut at."""

    netcut: NetCut
    cut_at: int
    restore_at: int


def _scenario_and_fault_step(opts: DemoOptions) -> tuple[Scenario, int | None]:
    """The chosen catalog scenario and the step its fault starts at (None: a healthy run)."""
    if opts.scenario not in SCENARIOS:
        raise DemoError(f"unknown scenario {opts.scenario!r}; choose one of {', '.join(SCENARIOS)}")
    sc = SCENARIOS[opts.scenario]
    fault_step = None if sc.fault == "healthy" else (opts.fault_step or default_fault_step(opts.steps))
    if fault_step is not None and not 1 <= fault_step <= opts.steps:
        raise DemoError(f"fault step {fault_step} is outside 1..{opts.steps}")
    return sc, fault_step


def _outage_window(opts: DemoOptions, bootstrap: str | None) -> tuple[int, int] | None:
    """``broker_outage``'s (cut, restore) steps, or None without one; it needs the embedded broker."""
    if opts.broker_outage is None:
        return None
    if bootstrap is not None:
        raise DemoError(
            "--broker-outage needs the embedded broker (every client must reach it "
            "through the outage proxy); leave out --bootstrap and RUNWATCH_BOOTSTRAP"
        )
    return outage_steps(opts.broker_outage, opts.steps)


def _start_broker(stack: ExitStack, logs: Path, advertised: str | None) -> EmbeddedBroker:
    """The embedded broker, started; ``stack`` stops it."""
    broker = EmbeddedBroker(log_path=logs / "broker.log", advertised=advertised).start()
    stack.callback(broker.stop)
    return broker


def _start_embedded_broker(
    stack: ExitStack, logs: Path, window: tuple[int, int] | None, log: Callable[[str], None]
) -> tuple[str, _Outage | None]:
    """The embedded broker, behind an outage proxy when there is an outage ``window`` (both stopped
    by ``stack``): the bootstrap address every client uses, and the outage."""
    if window is None:
        broker = _start_broker(stack, logs, None)
        log(f"embedded broker on {broker.bootstrap}")
        return broker.bootstrap, None
    proxy_port = free_port()
    broker = _start_broker(stack, logs, f"127.0.0.1:{proxy_port}")
    netcut = NetCut(("127.0.0.1", broker.port), port=proxy_port).start()
    stack.callback(netcut.stop)
    cut_at, restore_at = window
    log(
        f"embedded broker on {broker.bootstrap}, reached through the outage proxy on {netcut.bootstrap}; "
        f"it is cut from step {cut_at} to step {restore_at}"
    )
    return netcut.bootstrap, _Outage(netcut, cut_at, restore_at)


def _connect_broker(
    opts: DemoOptions, stack: ExitStack, logs: Path, log: Callable[[str], None]
) -> tuple[str, _Outage | None]:
    """The broker to use (the given one, else an embedded one that ``stack`` stops), its topics
    made: its bootstrap address, and the outage when ``broker_outage`` asks for one."""
    bootstrap = opts.bootstrap or topics.bootstrap_from_env()
    window = _outage_window(opts, bootstrap)
    outage = None
    if bootstrap is None:
        bootstrap, outage = _start_embedded_broker(stack, logs, window, log)
    ensure_topics(bootstrap)
    return bootstrap, outage


def _start_sink(
    stack: ExitStack,
    dsn: str | None,
    bootstrap: str,
    public_keys: ActionPublicKeys,
    log: Callable[[str], None],
) -> tuple[ClickHouseSink, SinkConsumer, Callable[[], None]]:
    """The ClickHouse sink and its consumer, running in a thread: the sink, the consumer and the
    function that stops the thread (``stack`` stops it and closes the sink)."""
    sink = ClickHouseSink(dsn)
    stack.callback(sink.close)
    sink.migrate()
    sink_consumer = SinkConsumer(sink, bootstrap, batch_interval_s=0.25, public_keys=public_keys)
    sink_thread = threading.Thread(target=sink_consumer.run, name="runwatch-sink", daemon=True)
    sink_thread.start()

    def stop_sink() -> None:
        sink_consumer.stopping.set()
        sink_thread.join(30)

    stack.callback(stop_sink)
    log(f"ClickHouse sink writing to {sink.dsn}")
    return sink, sink_consumer, stop_sink


def _action_logger(log: Callable[[str], None]) -> Callable[[AppliedAction], None]:
    """The trainer's ``on_action``: log each action it took or ignored."""

    def on_action(applied: AppliedAction) -> None:
        a = applied.action
        extra = f" to step {applied.to_step}" if applied.to_step is not None else ""
        log(f"trainer {applied.outcome} {a.kind}{extra}: {a.reason}")

    return on_action


def _outage_step_hook(
    outage: _Outage | None,
    rw: RunWatch,
    on_step: Callable[[int, float], None] | None,
    log: Callable[[str], None],
) -> Callable[[int, float], None] | None:
    """The trainer's ``on_step``: ``on_step``, after cutting the broker off and restoring it at the
    outage's steps when there is an outage."""
    if outage is None:
        return on_step
    netcut = outage.netcut

    def step_hook(step: int, loss: float) -> None:
        if step >= outage.restore_at and netcut.is_cut:
            netcut.restore()
            log(
                f"broker reachable again at step {step} after {netcut.down_s:.1f}s; "
                f"{rw.stats.spooled} events spooled so far"
            )
        elif step >= outage.cut_at and not netcut.cuts:
            netcut.cut()
            log(f"broker cut off at step {step}")
        if on_step is not None:
            on_step(step, loss)

    return step_hook


def _train_scenario(
    sc: Scenario,
    opts: DemoOptions,
    fault_step: int | None,
    rw: RunWatch,
    listener: ActionListener,
    step_hook: Callable[[int, float], None] | None,
    on_action: Callable[[AppliedAction], None],
) -> tuple[TrainingResult, int | None]:
    """Train: a recorded scenario's real run, or the demo model with the scenario's fault at
    ``fault_step``; the result and the fault step (a recorded run's is its onset)."""
    if sc.recorded:
        return _run_recorded_scenario(sc, rw, listener, opts.step_interval_s, step_hook, on_action)
    cfg = TrainingConfig(
        scenario=sc,
        steps=opts.steps,
        fault_step=fault_step,
        step_interval_s=opts.step_interval_s,
        checkpoint_dir=STATE_DIR / "checkpoints",
        stall_step=opts.stall_step,
        stall_s=opts.stall_s,
    )
    return train(cfg, rw, listener, on_step=step_hook, on_action=on_action), fault_step


def _close_run(
    rw: RunWatch, result: TrainingResult, outage: _Outage | None, log: Callable[[str], None]
) -> PublisherStats:
    """End the run (the broker reachable again first) and log what its spool did: its stats."""
    if outage is not None and outage.netcut.is_cut:  # the run ended (or stopped) inside the window
        outage.netcut.restore()
    stats = rw.close(timeout=30, status="stopped" if result.stopped else "completed")
    if stats.spooled or stats.spool_recovered:
        log(
            f"spool: {stats.spooled} events spooled, {stats.replayed} replayed, "
            f"{stats.spool_dropped} dropped by its bound, {stats.spooled_at_close} left at close"
        )
    return stats


def _wait_until_stored(
    rw: RunWatch,
    worker: WorkerProcess | None,
    bootstrap: str,
    sink_consumer: SinkConsumer,
    timeout_s: float,
) -> None:
    """Wait until every published event is stored: the worker has committed past the last
    acknowledged offset (Faust flushes its sends before committing), then the sink has stored past
    it and drained what the worker produced."""
    delivered = rw.delivered_offsets()
    for partition, offset in delivered.items():
        if worker is not None:

            def worker_past(p: int = partition, o: int = offset) -> bool:
                return committed_offset(bootstrap, DETECT_GROUP, topics.TELEMETRY, p) > o

            wait_until(worker_past, timeout_s, "the worker to process every event", interval=0.25)

        def sink_past(p: int = partition, o: int = offset) -> bool:
            return sink_consumer.stored_through(topics.TELEMETRY, p) > o

        wait_until(sink_past, timeout_s, "the sink to store every event")
    caught_up = time.monotonic()
    wait_until(lambda: sink_consumer.stats.last_empty_poll > caught_up + 0.3, 30, "the sink to drain")


def _write_report(sink: ClickHouseSink, run_id: str, log: Callable[[str], None]) -> Path | None:
    """The run's HTML report (made here: this process holds the embedded ClickHouse path), or None
    when it could not be written (the run and its results stand without it)."""
    report_path: Path | None = None
    try:
        report_path = write_report(sink, run_id, REPORTS_DIR / f"report-{run_id}.html").path
        log(f"report written to {report_path}")
    except Exception as exc:  # noqa: BLE001 - the run and its results stand without the report
        log(f"the report could not be written: {type(exc).__name__}: {exc}")
    return report_path


def _final_goodput(sink: ClickHouseSink, run_id: str, log: Callable[[str], None]) -> dict[str, Any] | None:
    """The run summarised once more now that everything is stored (the sink summarised it at its
    run_end, perhaps before its last findings arrived), and its goodput (docs/goodput.md) as the
    report's ``goodput``: wall time, goodput and each category's seconds; None when it failed."""
    from runwatch.sinks.goodput import stored_goodput
    from runwatch.sinks.summaries import summarize_stored_run

    try:
        summarize_stored_run(sink, run_id, "running")
        found = stored_goodput(sink, run_id)
    except Exception as exc:  # noqa: BLE001 - the run and its results stand without it
        log(f"the goodput could not be computed: {type(exc).__name__}: {exc}")
        return None
    if found is None:
        return None
    return {"wall_s": found.wall_s, "goodput": found.goodput, "seconds": found.seconds()}


def _spool_summary(rw: RunWatch, stats: PublisherStats) -> dict[str, Any]:
    return {
        "path": str(rw.spool_path) if rw.spool_path else None,
        "spooled": stats.spooled,
        "replayed": stats.replayed,
        "dropped": stats.spool_dropped,
        "recovered": stats.spool_recovered,
        "at_close": stats.spooled_at_close,
        "duplicates_sent": stats.duplicates_sent,
    }


def _outage_summary(outage: _Outage | None) -> dict[str, Any] | None:
    if outage is None:
        return None
    return {
        "from_step": outage.cut_at,
        "to_step": outage.restore_at,
        "down_s": round(outage.netcut.down_s, 2),
    }


def _demo_keys(start_worker: bool) -> tuple[ActionSigningKey | None, ActionPublicKeys]:
    """The worker's signing key (None: no worker is started here) and the public keys the trainer and the
    sink verify with: ``$RUNWATCH_ACTION_SIGNING_KEY`` / ``$RUNWATCH_ACTION_PUBLIC_KEYS`` when set, else a
    pair made for this run."""
    try:
        key = None
        if start_worker:
            given = os.environ.get(topics.SIGNING_KEY_ENV)
            key = resolve_signing_key(given) if given else ActionSigningKey.generate()
        if os.environ.get(topics.PUBLIC_KEYS_ENV) or key is None:  # (another worker's: its public key)
            return key, resolve_public_keys()
        return key, ActionPublicKeys([key.public])
    except MissingKeyError as exc:
        raise DemoError(str(exc)) from None


def run_demo(
    opts: DemoOptions,
    log: Callable[[str], None] = lambda _m: None,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    run_id = f"demo-{opts.scenario}-{uuid.uuid4().hex[:8]}"
    sc, fault_step = _scenario_and_fault_step(opts)
    signing_key, public_keys = _demo_keys(opts.start_worker)
    logs = STATE_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    with ExitStack() as stack:
        bootstrap, outage = _connect_broker(opts, stack, logs, log)

        worker = None
        if signing_key is not None:
            worker = WorkerProcess(bootstrap, signing_key, logs / f"worker-{run_id}.log", opts.config_path)
            stack.callback(worker.stop)

        sink, sink_consumer, stop_sink = _start_sink(stack, opts.dsn, bootstrap, public_keys, log)

        rw = RunWatch(run_id, bootstrap, run_start={"tags": {"scenario": opts.scenario}, "seed": 0})
        listener = ActionListener(rw, public_keys=public_keys)
        stack.callback(listener.close)
        if worker is not None:
            worker.wait_ready(60)
            log("worker joined its consumer group")
        wait_until(sink_consumer.assigned.is_set, 60, "the sink to join its consumer group")
        wait_until(lambda: listener.wait_ready(0.1), 30, "the action listener")

        step_hook = _outage_step_hook(outage, rw, on_step, log)
        result, fault_step = _train_scenario(
            sc, opts, fault_step, rw, listener, step_hook, _action_logger(log)
        )
        stats = _close_run(rw, result, outage, log)

        # Nothing is reported until every published event is stored.
        _wait_until_stored(rw, worker, bootstrap, sink_consumer, opts.timeout_s)
        stop_sink()

        goodput = _final_goodput(sink, run_id, log)
        counts = sink.runs.counts(run_id)
        anomalies = sink.runs.anomalies(run_id)
        actions = sink.runs.actions(run_id)
        report_path = _write_report(sink, run_id, log)

    return {
        "run_id": run_id,
        "scenario": opts.scenario,
        "fault_step": fault_step,
        "steps": opts.steps,
        "steps_completed": result.steps_completed,
        "steps_executed": result.steps_executed,
        "final_loss": result.final_loss,
        "nonfinite_steps_after_last_rollback": result.nonfinite_after_last_rollback
        if result.rollbacks
        else None,
        "stopped": result.stopped,
        "anomalies": anomalies,
        "actions": actions,
        "rollbacks": [
            {
                "from_step": r["from_step"],
                "to_step": r["to_step"],
                "action_id": r["action_id"],
                "lr_scale": r.get("lr_scale"),
            }
            for r in result.rollbacks
        ],
        "actions_ignored_by_trainer": dict(listener.ignored),
        "clickhouse": {**counts, "telemetry_rows": counts["telemetry"]},
        "clickhouse_dsn": sink.dsn,
        "report": None if report_path is None else str(report_path),
        "events_published": stats.published,
        "events_dropped": stats.dropped,
        "spool": _spool_summary(rw, stats),
        "broker_outage": _outage_summary(outage),
        "goodput": goodput,
        "wall_time_s": round(time.monotonic() - started, 2),
    }
