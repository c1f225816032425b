"""A run's history for the worker: loaded from ClickHouse when a run starts and handed to its
monitor, whose detectors do no I/O themselves.

``BaselineLoader.hand(monitor, run_start)`` loads, for the run's baseline key and hardware
fingerprint, the candidate summaries (``BaselineReads.candidates``), chooses the run's
history from them (``check.select_history``, the gate's rule) and builds the per-step band of its
newest ``max_runs`` runs (``BaselineReads.band_of_runs``). The band goes to the
``baseline_trajectory`` detector (in flight), the history to the run-end check
(``baselines/gate.py``). Both are cached per (key, fingerprint) for ``ttl_s``: runs started within
that time share what the first of them loaded. A load runs in a background thread and is waited
for at most ``timeout_s``, so detection is never held up for long: a load that takes longer leaves
the run without (its detector says so once) and fills the cache for the runs after it. Any failure
(ClickHouse unreachable, a query error) is one log line and silence, never an error of the run.

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
from typing import Any

from runwatch.contract.schema import RunStartEvent
from runwatch.detectors.baseline_trajectory import hand_band
from runwatch.detectors.baselines.band import BaselineBand, declares_new_baseline, run_fingerprint
from runwatch.detectors.baselines.check import select_history
from runwatch.detectors.baselines.summary import RunSummarizer, RunSummary
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import RunMonitor

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 600.0
DEFAULT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Baseline:
    """What was loaded for one baseline key and fingerprint."""

    candidates: list[RunSummary]
    band: BaselineBand | None


@dataclass
class _Entry:
    loaded_at: float
    future: Future[Baseline]


class BaselineLoader:
    """Loads and caches runs' histories; ``hand`` gives one to a run's monitor at its start."""

    def __init__(
        self,
        dsn: str,
        config: RunwatchConfig,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        sink: Any = None,
    ):
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
        """Give the run's history to its run-end check and its band to its in-flight detector (or the
        reason there is none)."""
        loaded, reason = self.load_for(start)
        history = None if loaded is None else self._history(start, loaded.candidates)
        monitor.set_history(history, reason)
        if not self.config.detectors.baseline_trajectory.enabled:
            return
        band = None if loaded is None else loaded.band
        if loaded is not None and band is None:
            reason = (
                f"no earlier completed run of baseline {start.baseline_key!r} on this hardware in the last "
                f"{self.config.baseline.window_days:g} days: no comparison with history"
            )
        if band is None:
            log.info("run %s: baseline_trajectory is silent: %s", start.run_id, reason)
        hand_band(monitor.joined_detectors, band, reason)

    def band_for(self, start: RunStartEvent) -> tuple[BaselineBand | None, str | None]:
        """The run's band, or None and why."""
        loaded, reason = self.load_for(start)
        if loaded is not None and loaded.band is None:
            reason = (
                f"no earlier completed run of baseline {start.baseline_key!r} on this hardware in the last "
                f"{self.config.baseline.window_days:g} days: no comparison with history"
            )
        return (loaded.band if loaded is not None else None), reason

    def load_for(self, start: RunStartEvent) -> tuple[Baseline | None, str | None]:
        """What was loaded for the run's baseline key and fingerprint, or None and why."""
        key = start.baseline_key
        if not key:
            return None, "the run has no baseline_key: no comparison with history"
        if declares_new_baseline(start):
            return None, f"the run declares a new baseline of {key!r}: no earlier run is its history"
        fingerprint = run_fingerprint(start)
        future = self._future(key, fingerprint, start)
        try:
            return future.result(timeout=self.timeout_s), None
        except FutureTimeout:
            return None, f"the history of {key!r} did not load within {self.timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - any failure leaves the run without, and says why
            with self._lock:
                self._cache.pop((key, fingerprint), None)  # try again for the next run
            return None, f"the history of {key!r} could not be loaded: {type(exc).__name__}: {exc}"

    def _history(self, start: RunStartEvent, candidates: list[RunSummary]) -> list[RunSummary]:
        return select_history(_probe(start), candidates, self.config.baseline)

    def _future(self, key: str, fingerprint: str, start: RunStartEvent) -> Future[Baseline]:
        now = self._clock()
        with self._lock:
            entry = self._cache.get((key, fingerprint))
            if entry is None or now - entry.loaded_at > self.ttl_s:
                entry = self._cache[(key, fingerprint)] = _Entry(now, self._pool.submit(self._load, start))
            return entry.future

    def _load(self, start: RunStartEvent) -> Baseline:
        from runwatch.sinks.clickhouse import ClickHouseSink

        if self._sink is None:
            self._sink = ClickHouseSink(self.dsn)
        probe = _probe(start)
        assert probe.baseline_key is not None  # load_for checked
        section = self.config.detectors.baseline_trajectory
        started = time.perf_counter()
        candidates = self._sink.baselines.candidates(
            probe.baseline_key, probe.fingerprint, start.ts, self.config.baseline.window_days
        )
        history = select_history(probe, candidates, self.config.baseline)
        band: BaselineBand | None = None
        if section.enabled and section.max_runs > 0:
            band = self._sink.baselines.band_of_runs(
                [r.run_id for r in history[-section.max_runs :]],
                probe.baseline_key,
                probe.fingerprint,
                max_buckets=section.max_buckets,
            )
        log.info(
            "history of %s (%s): %d run(s), a band of %s run(s) with %d metrics, loaded in %.3f s",
            probe.baseline_key,
            probe.fingerprint,
            len(history),
            band.n_runs if band else 0,
            len(band.metrics) if band else 0,
            time.perf_counter() - started,
        )
        return Baseline(candidates, band)


def _probe(start: RunStartEvent) -> RunSummary:
    """The run as far as its start tells: what choosing its history needs."""
    summarizer = RunSummarizer(start.run_id)
    summarizer.observe(start)
    return summarizer.summary()
