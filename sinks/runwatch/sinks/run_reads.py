"""``RunReads``: what is stored of one run, read back (``sink.runs``): row counts, its anomalies and
actions, its events decoded, the runs whose events stopped without a summary, the remediator's records;
and the runs list (``overview``)."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from runwatch.contract.schema import Anomaly
from runwatch.sinks.rows import REMEDIATION_COLUMNS, as_utc

if TYPE_CHECKING:
    from runwatch.contract.schema import TelemetryEvent
    from runwatch.sinks.connection import Connection

log = logging.getLogger(__name__)


class RunReads:
    def __init__(self, sink: Connection):
        self.query = sink.query

    def counts(self, run_id: str) -> dict[str, int]:
        """Rows per table for one run, after deduplication."""
        counts = {}
        for table in ("telemetry", "anomalies", "actions"):
            rows = self.query(
                f"SELECT count() FROM {{db}}.{table} FINAL WHERE run_id = %(run)s", {"run": run_id}
            )
            counts[table] = int(rows[0][0])
        rows = self.query(
            "SELECT count() FROM {db}.deadletter FINAL WHERE run_key = %(run)s", {"run": run_id}
        )
        counts["deadletter"] = int(rows[0][0])
        return counts

    def anomalies(self, run_id: str) -> list[dict[str, Any]]:
        """One run's anomalies (detector, step, severity, rank, message), by step and detector."""
        rows = self.query(
            "SELECT detector, step, severity, rank, message FROM {db}.anomalies FINAL "
            "WHERE run_id = %(run)s ORDER BY step, detector",
            {"run": run_id},
        )
        return [
            {"detector": d, "step": s, "severity": sev, "rank": r, "message": m} for d, s, sev, r, m in rows
        ]

    def actions(self, run_id: str) -> list[dict[str, Any]]:
        """One run's actions (kind, step, action_id, reason), in the order they were issued."""
        rows = self.query(
            "SELECT kind, step, action_id, reason FROM {db}.actions FINAL "
            "WHERE run_id = %(run)s ORDER BY issued_at",
            {"run": run_id},
        )
        return [{"kind": k, "step": s, "action_id": a, "reason": why} for k, s, a, why in rows]

    def stored_events(self, run_id: str) -> list[TelemetryEvent]:
        """The run's stored telemetry decoded from its payloads, in time order: every event of rank 0
        and the step events of the other ranks (what ``RunSummarizer`` uses: rank 0's steps for the
        step figures, every rank's memory maxima; other ranks' heartbeats and acks add nothing to
        it). A payload that no longer decodes is skipped with a warning."""
        from runwatch.contract.schema import SchemaError, decode_event

        rows = self.query(
            "SELECT payload FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND (rank = 0 OR kind = 'step') "
            "ORDER BY ts, rank, step, event_id",
            {"r": run_id},
        )
        events = []
        for (payload,) in rows:
            try:
                events.append(decode_event(payload))
            except SchemaError as exc:
                log.warning(
                    "runwatch sink: a stored event of run %s does not decode (%s); skipped",
                    run_id,
                    exc.reason,
                )
        return events

    def stored_anomalies(self, run_id: str) -> list[Anomaly]:
        """The run's stored anomalies (identity, step, detector, metric, severity, message), by time."""
        rows = self.query(
            "SELECT anomaly_id, run_id, ts, step, rank, detector, metric, severity, message "
            "FROM {db}.anomalies FINAL WHERE run_id = %(r)s ORDER BY ts, anomaly_id",
            {"r": run_id},
        )
        return [
            Anomaly.model_construct(
                anomaly_id=a,
                run_id=r,
                ts=ts,
                step=step,
                rank=rank,
                detector=d,
                metric=m,
                severity=sev,
                message=msg,
            )
            for a, r, ts, step, rank, d, m, sev, msg in rows
        ]

    def to_summarize(self, now: datetime, died_after_s: float, lookback_s: float = 7 * 86400) -> list[str]:
        """Runs with telemetry whose last event is more than ``died_after_s`` before ``now`` and that
        have no summary, or only one of status ``running``: runs whose events stopped without a
        summary (their heartbeats stopped: they died), oldest last event first. Only runs with an
        event in the ``lookback_s`` before the cutoff are looked at, so the sweep does not read the
        whole telemetry table every time (a run that died longer ago than that while the sink was
        away is summarised by ``runwatch baseline check`` when asked for)."""
        cutoff = as_utc(now) - timedelta(seconds=died_after_s)
        rows = self.query(
            "SELECT run_id, max(ts) AS last FROM {db}.telemetry WHERE ts >= %(since)s GROUP BY run_id "
            "HAVING last < %(cutoff)s "
            "AND run_id NOT IN (SELECT run_id FROM {db}.run_summaries FINAL WHERE status != 'running') "
            "ORDER BY last, run_id",
            {"cutoff": cutoff, "since": cutoff - timedelta(seconds=lookback_s)},
        )
        return [str(r[0]) for r in rows]

    def remediation_keys(self) -> set[tuple[str, str]]:
        """Every (action_id, target_key) the remediator has recorded, whatever its status."""
        rows = self.query("SELECT DISTINCT action_id, target_key FROM {db}.remediations")
        return {(r[0], r[1]) for r in rows}

    def remediations(self, action_id: str) -> list[dict[str, Any]]:
        """The recorded executions for one action, oldest first, by column name."""
        rows = self.query(
            "SELECT " + ", ".join(REMEDIATION_COLUMNS) + " FROM {db}.remediations FINAL "
            "WHERE action_id = %(a)s ORDER BY started_at",
            {"a": action_id},
        )
        return [dict(zip(REMEDIATION_COLUMNS, r, strict=True)) for r in rows]

    def start_payload(self, run_id: str) -> Any:
        """The stored ``payload`` of the run's newest ``run_start`` event, or None."""
        rows = self.query(
            "SELECT payload FROM {db}.telemetry WHERE run_id = %(r)s AND kind = 'run_start' "
            "ORDER BY ts DESC LIMIT 1",
            {"r": run_id},
        )
        return rows[0][0] if rows else None

    def overview(self, now: datetime, silent_after_s: float = 120.0, limit: int = 200) -> list[RunOverview]:
        """The newest ``limit`` runs, newest first, each with its status, attempt, last step, findings by
        severity, actions by kind and whether its baseline check at run end found outliers: what the
        local page's runs list and ``runwatch runs`` show. A run with no ``run_end`` and no summary is
        ``running`` while it sent something in the last ``silent_after_s``, else ``silent``."""
        rows = self.query(
            "SELECT run_id, max(ts), maxIf(step, kind = 'step'), uniqExactIf(event_id, kind = 'step'), "
            "argMaxIf(JSONExtractString(payload, 'attempt'), ts, kind = 'run_start'), "
            "argMaxIf(JSONExtractString(payload, 'status'), ts, kind = 'run_end'), min(ts) "
            "FROM {db}.telemetry GROUP BY run_id ORDER BY max(ts) DESC LIMIT %(limit)s",
            {"limit": limit},
        )
        if not rows:
            return []
        runs = [r[0] for r in rows]
        findings = self._by(runs, "SELECT run_id, severity, count() FROM {db}.anomalies FINAL")
        actions = self._by(runs, "SELECT run_id, kind, count() FROM {db}.actions FINAL")
        outliers = self._by(
            runs,
            "SELECT run_id, detector, count() FROM {db}.anomalies FINAL",
            "AND detector = 'baseline_outliers'",
        )
        summaries = dict(
            self.query(
                "SELECT run_id, argMax(status, written_at) FROM {db}.run_summaries "
                "WHERE run_id IN %(runs)s GROUP BY run_id",
                {"runs": runs},
            )
        )
        out = []
        for run_id, last_ts, last_step, steps, attempt, end_status, first_ts in rows:
            last = as_utc(last_ts)
            status = (
                end_status
                or summaries.get(run_id)
                or ("running" if (now - last).total_seconds() < silent_after_s else "silent")
            )
            out.append(
                RunOverview(
                    run_id=run_id,
                    status=status,
                    attempt=attempt or None,
                    first_event=as_utc(first_ts),
                    last_event=last,
                    last_step=last_step if steps else None,
                    steps=int(steps),
                    findings=findings.get(run_id, {}),
                    actions=actions.get(run_id, {}),
                    baseline_outliers=bool(outliers.get(run_id)),
                )
            )
        return out

    def _by(self, runs: list[str], select: str, where: str = "") -> dict[str, dict[str, int]]:
        """``select`` (run id, a key, a count) over ``runs``, grouped: run id -> key -> count."""
        grouped: dict[str, dict[str, int]] = {}
        for run_id, key, n in self.query(
            f"{select} WHERE run_id IN %(runs)s {where} GROUP BY run_id, 2", {"runs": runs}
        ):
            grouped.setdefault(run_id, {})[key] = int(n)
        return grouped


class RunOverview(BaseModel):
    """One row of the runs list (the local page, ``runwatch runs``)."""

    run_id: str
    status: str  # completed, failed, stopped, interrupted (its run_end), died (its summary), running, silent
    attempt: str | None
    first_event: datetime
    last_event: datetime
    last_step: int | None
    steps: int  # step events stored (every rank's)
    findings: dict[str, int]  # by severity
    actions: dict[str, int]  # by kind
    baseline_outliers: bool  # the baseline check at run end found outliers

    @property
    def rollbacks(self) -> int:
        return self.actions.get("rollback", 0)
