"""A restore's progress, for the worker's health endpoint and log (docs/state.md, "Restoring"): a restore
of thousands of runs takes tens of seconds, and a worker that hears nothing from its detector process
for its timeout takes it for frozen."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class RestoreProgress:
    """How a restore goes, reported about once a second to ``report`` and every few seconds to the log:
    so that a long restore is seen to make progress (and its worker is not taken for frozen)."""

    EVERY_S = 1.0
    LOG_EVERY_S = 5.0

    def __init__(
        self,
        partitions: list[int],
        perf: Callable[[], float],
        report: Callable[[dict[str, Any]], None] | None,
    ):
        self.partitions = partitions
        self._perf = perf
        self._report = report
        self.started = self._last = self._logged = perf()

    def reading(self, records: int) -> None:
        self._maybe({"phase": "reading", "records_read": records})

    def restoring(self, runs: int, records: int) -> None:
        if self._perf() - self._last >= self.EVERY_S:  # (checked first: called once per record)
            self._maybe({"phase": "restoring", "runs_restored": runs, "records": records})

    def done(self, runs: int, records: int) -> None:
        self._send({"phase": "done", "runs_restored": runs, "records": records}, log_it=False)

    def _maybe(self, what: dict[str, Any]) -> None:
        now = self._perf()
        if now - self._last >= self.EVERY_S:
            self._send(what, log_it=now - self._logged >= self.LOG_EVERY_S)

    def _send(self, what: dict[str, Any], log_it: bool) -> None:
        now = self._perf()
        self._last = now
        body = {"partitions": self.partitions, **what, "elapsed_s": round(now - self.started, 3)}
        if log_it:
            self._logged = now
            log.info(
                "restoring telemetry partition(s) %s: %s",
                self.partitions,
                ", ".join(f"{k} {v}" for k, v in what.items()),
            )
        if self._report is not None:
            self._report(body)
