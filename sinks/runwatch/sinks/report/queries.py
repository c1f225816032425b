"""``ReportReads``: the run report's reads (``sink.report``; issue 15: ``runwatch report``). Each returns
plain rows by column name; the report plots them against the step, in time order (a step replayed after
a rollback appears once per pass)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from runwatch.sinks.rows import as_utc
from runwatch.sinks.run_reads import RunReads

if TYPE_CHECKING:
    from runwatch.sinks.connection import Connection


class ReportReads:
    def __init__(self, sink: Connection):
        self.query = sink.query
        self._runs = RunReads(sink)  # (stateless: the same reads as ``sink.runs``)

    def run_info(self, run_id: str) -> dict[str, Any] | None:
        """What is stored of one run: event count, first and last event time, ranks, last step, and the
        newest ``run_start`` and ``run_end`` payloads (JSON text or None); None for an unknown run."""
        rows = self.query(
            "SELECT count(), min(ts), max(ts), uniqExact(rank), max(step) FROM {db}.telemetry FINAL "
            "WHERE run_id = %(r)s",
            {"r": run_id},
        )
        if not rows or not rows[0][0]:
            return None
        events, first, last, ranks, last_step = rows[0]
        end = self.query(
            "SELECT payload FROM {db}.telemetry WHERE run_id = %(r)s AND kind = 'run_end' "
            "ORDER BY ts DESC LIMIT 1",
            {"r": run_id},
        )
        return {
            "events": int(events),
            "first_ts": as_utc(first),
            "last_ts": as_utc(last),
            "ranks": int(ranks),
            "last_step": None if last_step is None else int(last_step),
            "run_start": self._runs.start_payload(run_id),
            "run_end": end[0][0] if end else None,
        }

    def steps(self, run_id: str, rank: int = 0) -> list[dict[str, Any]]:
        """One rank's step events in time order, each with ``REPORT_STEP_FIELDS`` (None where absent or
        not a finite JSON number), ``lr`` (each param group's) and ``category_loss`` (its raw JSON)."""
        extracted = ", ".join(
            f"JSONExtract(payload, {path}, 'Nullable(Float64)') AS {name}"
            for name, path in REPORT_STEP_FIELDS.items()
        )
        columns = (
            "ts",
            "step",
            "loss",
            "grad_norm",
            "step_time_s",
            *REPORT_STEP_FIELDS,
            "lr",
            "category_loss",
        )
        rows = self.query(
            f"SELECT ts, step, loss, grad_norm, step_time_s, {extracted}, "
            "JSONExtract(payload, 'lr', 'Array(Nullable(Float64))') AS lr, "
            "JSONExtractRaw(payload, 'category_loss') AS category_loss "
            "FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND rank = %(rank)s AND kind = 'step' "
            "ORDER BY ts, step, event_id",
            {"r": run_id, "rank": rank},
        )
        return [dict(zip(columns, row, strict=True)) for row in rows]

    def rank_step_times(self, run_id: str) -> list[dict[str, Any]]:
        """Every rank's step time and compute time per step event, by rank then time."""
        rows = self.query(
            "SELECT rank, step, ts, step_time_s, JSONExtract(payload, 'compute_s', 'Nullable(Float64)') "
            "FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND kind = 'step' ORDER BY rank, ts, step",
            {"r": run_id},
        )
        return [
            {"rank": int(rk), "step": s, "ts": as_utc(ts), "step_time_s": st, "compute_s": c}
            for rk, s, ts, st, c in rows
        ]

    def module_grad_norms(self, run_id: str, top: int = 8) -> list[dict[str, Any]]:
        """Rank 0's per-module grad norms of the ``top`` modules with the largest finite norm, in time
        order: rows of (module, step, norm)."""
        rows = self.query(_REPORT_MODULES_SQL, {"r": run_id, "k": int(top)})
        return [{"module": m, "step": int(s), "norm": v} for m, s, v in rows]

    def module_heatmap(self, run_id: str, bucket_steps: int, modules: int = 40) -> list[dict[str, Any]]:
        """Rank 0's largest finite grad norm per module and step bucket (``bucket_steps`` steps each), for
        the ``modules`` modules with the largest norm: rows of (module, bucket's first step, norm)."""
        rows = self.query(
            _REPORT_HEATMAP_SQL, {"r": run_id, "k": int(modules), "b": max(1, int(bucket_steps))}
        )
        return [{"module": m, "step": int(s), "norm": v} for m, s, v in rows]

    def evals(self, run_id: str) -> list[dict[str, Any]]:
        """Rank 0's eval events in time order: step, split, loss and the metrics (raw JSON)."""
        rows = self.query(
            "SELECT ts, step, JSONExtractString(payload, 'split'), loss, JSONExtractRaw(payload, 'metrics') "
            "FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND rank = 0 AND kind = 'eval' ORDER BY ts, step",
            {"r": run_id},
        )
        return [
            {"ts": as_utc(ts), "step": s, "split": sp or "val", "loss": loss, "metrics": m}
            for ts, s, sp, loss, m in rows
        ]

    def anomalies(self, run_id: str) -> list[dict[str, Any]]:
        """One run's anomalies with their figures, by step then time."""
        columns = (
            "ts",
            "step",
            "onset_step",
            "rank",
            "detector",
            "metric",
            "value",
            "threshold",
            "score",
            "severity",
            "message",
            "evidence",
        )
        rows = self.query(
            "SELECT " + ", ".join(columns) + " FROM {db}.anomalies FINAL WHERE run_id = %(r)s "
            "ORDER BY step, ts, detector",
            {"r": run_id},
        )
        found = [dict(zip(columns, row, strict=True)) for row in rows]
        for a in found:
            a["evidence"] = _json_object(a["evidence"])
        return found

    def actions(self, run_id: str) -> list[dict[str, Any]]:
        """One run's actions, in the order they were issued, with what the trainer answered (the newest
        ``action_ack`` of each: outcome, step and rollback target; None when it never answered)."""
        columns = ("action_id", "kind", "reason", "step", "onset_step", "target_step", "issued_at")
        rows = self.query(
            "SELECT " + ", ".join(columns) + " FROM {db}.actions FINAL WHERE run_id = %(r)s "
            "ORDER BY issued_at",
            {"r": run_id},
        )
        acks = {
            a: (o, s, t)
            for a, o, s, t in self.query(
                "SELECT JSONExtractString(payload, 'action_id') AS a, "
                "argMax(JSONExtractString(payload, 'outcome'), ts), "
                "argMax(JSONExtract(payload, 'step', 'Nullable(Int64)'), ts), "
                "argMax(JSONExtract(payload, 'to_step', 'Nullable(Int64)'), ts) "
                "FROM {db}.telemetry FINAL WHERE run_id = %(r)s AND kind = 'action_ack' GROUP BY a",
                {"r": run_id},
            )
        }
        out = []
        for row in rows:
            action = dict(zip(columns, row, strict=True))
            outcome, ack_step, to_step = acks.get(action["action_id"], (None, None, None))
            out.append({**action, "outcome": outcome, "ack_step": ack_step, "to_step": to_step})
        return out


# What ``ReportReads.steps`` takes from a step payload beyond the typed columns: name -> JSONExtract path.
REPORT_STEP_FIELDS: dict[str, str] = {
    "grad_norm_clipped": "'grad_norm_clipped'",
    "clip_ratio": "'clip_ratio'",
    "param_norm": "'param_norm'",
    "update_norm": "'update_norm'",
    "relative_update_norm": "'relative_update_norm'",
    "effective_lr_ratio": "'effective_lr_ratio'",
    "data_wait_s": "'data_wait_s'",
    "compute_s": "'compute_s'",
    "samples_per_s": "'samples_per_s'",
    "tokens_per_s": "'tokens_per_s'",
    "mfu": "'mfu'",
    "nonfinite_grads": "'nonfinite_grads'",
    "memory_allocated": "'memory', 'allocated'",
    "memory_reserved": "'memory', 'reserved'",
    "memory_peak": "'memory', 'peak'",
    "memory_host_rss": "'memory', 'host_rss'",
}

# Rank 0's module norms, one (module, step, norm) per step event; the modules with the largest finite norm.
_REPORT_MODULE_NORMS = """
    SELECT ts, assumeNotNull(step) AS step, kv.1 AS module, kv.2 AS norm
    FROM {db}.telemetry FINAL
    ARRAY JOIN JSONExtractKeysAndValues(payload, 'module_grad_norms', 'Nullable(Float64)') AS kv
    WHERE run_id = %(r)s AND rank = 0 AND kind = 'step' AND step IS NOT NULL
"""
_REPORT_TOP_MODULES = f"""
    SELECT module FROM ({_REPORT_MODULE_NORMS}) WHERE norm IS NOT NULL AND isFinite(assumeNotNull(norm))
    GROUP BY module ORDER BY max(norm) DESC, module LIMIT %(k)s
"""
_REPORT_MODULES_SQL = f"""
SELECT module, step, norm FROM ({_REPORT_MODULE_NORMS})
WHERE module IN ({_REPORT_TOP_MODULES})
ORDER BY module, ts, step
"""
_REPORT_HEATMAP_SQL = f"""
SELECT module, intDiv(step, %(b)s) * %(b)s AS bucket, max(norm)
FROM ({_REPORT_MODULE_NORMS})
WHERE module IN ({_REPORT_TOP_MODULES}) AND norm IS NOT NULL AND isFinite(assumeNotNull(norm))
GROUP BY module, bucket
ORDER BY module, bucket
"""


def _json_object(text: Any) -> dict[str, Any]:
    """A stored JSON object column as a dict ({} for anything else: the report shows what it can)."""
    try:
        value = orjson.loads(text) if isinstance(text, str | bytes) else text
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
