"""Baseline bands for the worker: loaded from ClickHouse when a run starts, handed to the run's
``baseline_trajectory`` detector (which does no I/O itself).

``BaselineBands.hand(monitor, run_start)`` looks up the band of the run's baseline key and hardware
fingerprint (``ClickHouseSink.baseline_band``: the newest completed runs of that key that started
before this one, in the window), cached per (key, fingerprint) for ``ttl_s``. A load runs in a
background thread and is waited for at most ``timeout_s``, so detection is never held up for long:
a load that takes longer leaves the run without a band (its detector says so once) and fills the
cache for the runs after it. Any failure (ClickHouse unreachable, a query error) is one log line and
a silent detector, never an error of the run.

An on-disk chdb path can be opened by one process only: give the worker a DSN of its own (a
ClickHouse server's ``http://...``, or a chdb path no other process holds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from runwatch.detectors.baseline_trajectory import hand_band
from runwatch.detectors.baselines.band import BaselineBand, declares_new_baseline, run_fingerprint
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import RunMonitor
from runwatch.producer.schema import RunStartEvent

log = logging.getLogger("runwatch.worker")

DEFAULT_TTL_S = 600.0
DEFAULT_TIMEOUT_S = 2.0


@dataclass
class _Entry:
    loaded_at: float
    future: Future[BaselineBand | None]


class BaselineBands:
    """Loads and caches baseline bands; ``hand`` gives one to a run's monitor at its start."""

    def __init__(self, dsn: str, config: RunwatchConfig, *, ttl_s: float = DEFAULT_TTL_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 sink: Any = None):
        """``sink``: an open ``ClickHouseSink`` to read from instead of opening ``dsn`` (for a process
        that already holds an on-disk chdb path)."""
        self.dsn = dsn
        self.config = config
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._cache: dict[tuple[str, str], _Entry] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runwatch-baselines")
        self._sink: Any = sink  # else opened on first use, in the loader thread

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def hand(self, monitor: RunMonitor, start: RunStartEvent) -> None:
        """Give the run's baseline band (or the reason it has none) to its detector."""
        if not self.config.detectors.baseline_trajectory.enabled:
            return
        band, reason = self.band_for(start)
        if band is None:
            log.info("run %s: baseline_trajectory is silent: %s", start.run_id, reason)
        hand_band(monitor.joined_detectors, band, reason)

    def band_for(self, start: RunStartEvent) -> tuple[BaselineBand | None, str | None]:
        """The run's band, or None and why."""
        key = start.baseline_key
        if not key:
            return None, "the run has no baseline_key: no comparison with history"
        if declares_new_baseline(start):
            return None, f"the run declares a new baseline of {key!r}: no earlier run is its history"
        fingerprint = run_fingerprint(start)
        future = self._future(key, fingerprint, start.ts, start.run_id)
        try:
            band = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            return None, f"the baseline band of {key!r} did not load within {self.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure leaves the run without a band, and says why
            with self._lock:
                self._cache.pop((key, fingerprint), None)  # try again for the next run
            return None, f"the baseline band of {key!r} could not be loaded: {type(exc).__name__}: {exc}"
        if band is None:
            return None, (f"no earlier completed run of baseline {key!r} on this hardware in the last "
                          f"{self.config.baseline.window_days:g} days: no comparison with history")
        return band, None

    def _future(self, key: str, fingerprint: str, before: datetime, run_id: str) -> Future[BaselineBand | None]:
        now = self._clock()
        with self._lock:
            entry = self._cache.get((key, fingerprint))
            if entry is None or now - entry.loaded_at > self.ttl_s:
                entry = self._cache[(key, fingerprint)] = _Entry(
                    now, self._pool.submit(self._load, key, fingerprint, before, run_id))
            return entry.future

    def _load(self, key: str, fingerprint: str, before: datetime, run_id: str) -> BaselineBand | None:
        from runwatch.sinks.clickhouse import ClickHouseSink

        if self._sink is None:
            self._sink = ClickHouseSink(self.dsn)
        section = self.config.detectors.baseline_trajectory
        started = time.perf_counter()
        band: BaselineBand | None = self._sink.baseline_band(
            key, fingerprint, before, self.config.baseline.window_days, section.max_runs, exclude_run=run_id,
            max_buckets=section.max_buckets)
        log.info("baseline band of %s (%s): %s runs, %d metrics, loaded in %.3f s", key, fingerprint,
                 band.n_runs if band else 0, len(band.metrics) if band else 0, time.perf_counter() - started)
        return band
