"""Offline replay: the online detector code run over a recorded telemetry stream.

The clock is the events' own timestamps: ``tick`` runs at every ``tick_every_s`` of
event time between events, as the worker's timer does in wall time, so stall checks
fire at the moment they would have online.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from runwatch.contract.schema import Anomaly, SchemaError, StepEvent, TelemetryEvent, decode_event
from runwatch.detectors.baseline_trajectory import hand_band
from runwatch.detectors.baselines.band import BaselineBand
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import MonitorOutput, RunMonitor
from runwatch.detectors.engine.policy import ActionDecision

TICK_EVERY_S = 0.25  # the worker's timer period (worker/runwatch/worker/app.py), on event time
MAX_TICKS_PER_GAP = 400_000  # a recording with a days-long gap must not tick forever


class ReplayError(ValueError):
    pass


@dataclass
class ReplayResult:
    anomalies: list[Anomaly] = field(default_factory=list)
    decisions: list[ActionDecision] = field(default_factory=list)
    events: int = 0
    steps: int = 0  # step events
    runs: list[str] = field(default_factory=list)


def read_events(path: str | Path) -> list[TelemetryEvent]:
    """Every event of a JSONL recording, in file order; a bad line is an error naming the line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ReplayError(f"cannot read {path}: {exc.strerror}") from None
    events = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            events.append(decode_event(line))
        except SchemaError as exc:
            raise ReplayError(f"{path}:{lineno}: {exc.reason}") from None
    return events


def _ticks(monitor: RunMonitor, last: datetime, now: datetime, every: timedelta) -> Iterator[MonitorOutput]:
    t = last + every
    n = 0
    while t <= now and n < MAX_TICKS_PER_GAP:
        yield monitor.tick(t)
        t += every
        n += 1


def replay(
    events: Iterable[TelemetryEvent],
    config: RunwatchConfig | None = None,
    tick_every_s: float = TICK_EVERY_S,
    bands: Mapping[str, BaselineBand | str] | None = None,
) -> ReplayResult:
    """Feed ``events`` (in order) to one ``RunMonitor`` per run, ticking on event time. ``bands``: per
    run id, its baseline band, or the reason it has none (as the worker hands them in at run start)."""
    config = config or RunwatchConfig()
    every = timedelta(seconds=tick_every_s)
    monitors: dict[str, RunMonitor] = {}
    last_tick = {}
    result = ReplayResult()
    for event in events:
        monitor = monitors.get(event.run_id)
        if monitor is None:
            monitor = monitors[event.run_id] = RunMonitor(event.run_id, config)
            if bands is not None and event.run_id in bands:
                band = bands[event.run_id]
                hand_band(
                    monitor.joined_detectors, *((None, band) if isinstance(band, str) else (band, None))
                )
            result.runs.append(event.run_id)
            last_tick[event.run_id] = event.ts
        outputs = list(_ticks(monitor, last_tick[event.run_id], event.ts, every))
        if outputs:
            last_tick[event.run_id] += every * len(outputs)
        outputs.append(monitor.observe(event))
        for out in outputs:
            result.anomalies.extend(out.anomalies)
            result.decisions.extend(out.decisions)
        result.events += 1
        result.steps += isinstance(event, StepEvent)
    return result


def replay_file(
    path: str | Path, config: RunwatchConfig | None = None, tick_every_s: float = TICK_EVERY_S
) -> ReplayResult:
    return replay(read_events(path), config, tick_every_s)
