"""``runwatch demo``: the whole loop on one machine.

Starts what is missing (embedded broker, a Faust worker process, the ClickHouse sink
in this process, since an embedded chdb path belongs to one process), trains a real
model with a catalog scenario's fault, takes the actions, waits until every published
event is stored, shuts everything down and reports what happened, read back from ClickHouse.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from runwatch.demo.training import TrainingConfig, default_fault_step, train
from runwatch.local.broker import EmbeddedBroker, committed_offset, ensure_topics, free_port
from runwatch.local.netcut import NetCut
from runwatch.local.worker_process import WorkerProcess, wait_until
from runwatch.producer import ActionListener, AppliedAction, RunWatch
from runwatch.producer.wire import topics
from runwatch.scenarios.catalog import SCENARIOS, Scenario
from runwatch.scenarios.clocks import SimulatedClock
from runwatch.scenarios.live import TrainingResult
from runwatch.scenarios.training import run_scenario
from runwatch.sinks import ClickHouseSink, SinkConsumer
from runwatch.sinks.report import write_report
from runwatch.streams.worker.app import DETECT_GROUP

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


def run_demo(
    opts: DemoOptions,
    log: Callable[[str], None] = lambda _m: None,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    run_id = f"demo-{opts.scenario}-{uuid.uuid4().hex[:8]}"
    if opts.scenario not in SCENARIOS:
        raise DemoError(f"unknown scenario {opts.scenario!r}; choose one of {', '.join(SCENARIOS)}")
    sc = SCENARIOS[opts.scenario]
    fault_step = None if sc.fault == "healthy" else (opts.fault_step or default_fault_step(opts.steps))
    if fault_step is not None and not 1 <= fault_step <= opts.steps:
        raise DemoError(f"fault step {fault_step} is outside 1..{opts.steps}")
    secret = os.environ.get(topics.SECRET_ENV) or secrets.token_hex(32)
    logs = STATE_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    with ExitStack() as stack:
        bootstrap = opts.bootstrap or topics.bootstrap_from_env()
        netcut: NetCut | None = None
        if opts.broker_outage is not None:
            if bootstrap is not None:
                raise DemoError(
                    "--broker-outage needs the embedded broker (every client must reach it "
                    "through the outage proxy); leave out --bootstrap and RUNWATCH_BOOTSTRAP"
                )
            cut_at, restore_at = outage_steps(opts.broker_outage, opts.steps)
        if bootstrap is None:
            proxy_port = free_port() if opts.broker_outage is not None else None
            broker = EmbeddedBroker(
                log_path=logs / "broker.log", advertised=f"127.0.0.1:{proxy_port}" if proxy_port else None
            ).start()
            stack.callback(broker.stop)
            bootstrap = broker.bootstrap
            if proxy_port is not None:
                netcut = NetCut(("127.0.0.1", broker.port), port=proxy_port).start()
                stack.callback(netcut.stop)
                bootstrap = netcut.bootstrap
                log(
                    f"embedded broker on {broker.bootstrap}, reached through the outage proxy on {bootstrap}; "
                    f"it is cut from step {cut_at} to step {restore_at}"
                )
            else:
                log(f"embedded broker on {bootstrap}")
        ensure_topics(bootstrap)

        worker = None
        if opts.start_worker:
            worker = WorkerProcess(bootstrap, secret, logs / f"worker-{run_id}.log", opts.config_path)
            stack.callback(worker.stop)

        sink = ClickHouseSink(opts.dsn)
        stack.callback(sink.close)
        sink.migrate()
        sink_consumer = SinkConsumer(sink, bootstrap, batch_interval_s=0.25, secret=secret.encode())
        sink_thread = threading.Thread(target=sink_consumer.run, name="runwatch-sink", daemon=True)
        sink_thread.start()

        def stop_sink() -> None:
            sink_consumer.stopping.set()
            sink_thread.join(30)

        stack.callback(stop_sink)
        log(f"ClickHouse sink writing to {sink.dsn}")

        rw = RunWatch(run_id, bootstrap, run_start={"tags": {"scenario": opts.scenario}, "seed": 0})
        listener = ActionListener(rw, secret=secret)
        stack.callback(listener.close)
        if worker is not None:
            worker.wait_ready(60)
            log("worker joined its consumer group")
        wait_until(sink_consumer.assigned.is_set, 60, "the sink to join its consumer group")
        wait_until(lambda: listener.wait_ready(0.1), 30, "the action listener")

        cfg = TrainingConfig(
            scenario=sc,
            steps=opts.steps,
            fault_step=fault_step,
            step_interval_s=opts.step_interval_s,
            checkpoint_dir=STATE_DIR / "checkpoints",
        )

        def on_action(applied: AppliedAction) -> None:
            a = applied.action
            extra = f" to step {applied.to_step}" if applied.to_step is not None else ""
            log(f"trainer {applied.outcome} {a.kind}{extra}: {a.reason}")

        step_hook = on_step
        if netcut is not None:

            def step_hook(step: int, loss: float) -> None:
                if step >= restore_at and netcut.is_cut:
                    netcut.restore()
                    log(
                        f"broker reachable again at step {step} after {netcut.down_s:.1f}s; "
                        f"{rw.stats.spooled} events spooled so far"
                    )
                elif step >= cut_at and not netcut.cuts:
                    netcut.cut()
                    log(f"broker cut off at step {step}")
                if on_step is not None:
                    on_step(step, loss)

        if sc.recorded:
            result, fault_step = _run_recorded_scenario(
                sc, rw, listener, opts.step_interval_s, step_hook, on_action
            )
        else:
            result = train(cfg, rw, listener, on_step=step_hook, on_action=on_action)
        if netcut is not None and netcut.is_cut:  # the run ended (or stopped) inside the window
            netcut.restore()
        stats = rw.close(timeout=30, status="stopped" if result.stopped else "completed")
        if stats.spooled or stats.spool_recovered:
            log(
                f"spool: {stats.spooled} events spooled, {stats.replayed} replayed, "
                f"{stats.spool_dropped} dropped by its bound, {stats.spooled_at_close} left at close"
            )

        # Nothing is reported until every published event is stored: the worker has committed
        # past the last acknowledged offset (Faust flushes its sends before committing), then
        # the sink has stored past it and drained what the worker produced.
        delivered = rw.delivered_offsets()
        for partition, offset in delivered.items():
            if worker is not None:
                wait_until(
                    lambda p=partition, o=offset: (
                        committed_offset(bootstrap, DETECT_GROUP, topics.TELEMETRY, p) > o
                    ),
                    opts.timeout_s,
                    "the worker to process every event",
                    interval=0.25,
                )
            wait_until(
                lambda p=partition, o=offset: sink_consumer.stored_through(topics.TELEMETRY, p) > o,
                opts.timeout_s,
                "the sink to store every event",
            )
        caught_up = time.monotonic()
        wait_until(lambda: sink_consumer.stats.last_empty_poll > caught_up + 0.3, 30, "the sink to drain")
        stop_sink()

        counts = sink.runs.counts(run_id)
        anomalies = sink.runs.anomalies(run_id)
        actions = sink.runs.actions(run_id)
        # the report is made here: this process holds the embedded ClickHouse path
        report_path: Path | None = None
        try:
            report_path = write_report(sink, run_id, REPORTS_DIR / f"report-{run_id}.html").path
            log(f"report written to {report_path}")
        except Exception as exc:  # noqa: BLE001 - the run and its results stand without the report
            log(f"the report could not be written: {type(exc).__name__}: {exc}")

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
            {"from_step": r["from_step"], "to_step": r["to_step"], "action_id": r["action_id"]}
            for r in result.rollbacks
        ],
        "actions_ignored_by_trainer": dict(listener.ignored),
        "clickhouse": {**counts, "telemetry_rows": counts["telemetry"]},
        "clickhouse_dsn": sink.dsn,
        "report": None if report_path is None else str(report_path),
        "events_published": stats.published,
        "events_dropped": stats.dropped,
        "spool": {
            "path": str(rw.spool_path) if rw.spool_path else None,
            "spooled": stats.spooled,
            "replayed": stats.replayed,
            "dropped": stats.spool_dropped,
            "recovered": stats.spool_recovered,
            "at_close": stats.spooled_at_close,
            "duplicates_sent": stats.duplicates_sent,
        },
        "broker_outage": None
        if netcut is None
        else {
            "from_step": cut_at,
            "to_step": restore_at,
            "down_s": round(netcut.down_s, 2),
        },
        "wall_time_s": round(time.monotonic() - started, 2),
    }
