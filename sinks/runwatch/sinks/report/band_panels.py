"""The Baselines dashboard's panels: the run against its history's band at the same step."""

from __future__ import annotations

from typing import Any

from runwatch.sinks.report.data import ReportData
from runwatch.sinks.report.figures import (
    Panel,
    anomaly_trace,
    column,
    figure,
    layout,
    line,
    mark_actions,
    series,
    thin,
)

BAND_METRICS = ("loss", "grad_norm", "step_time_s", "memory_allocated", "memory_peak", "memory_host_rss")


def band_panels(data: ReportData) -> list[Panel]:
    """The run against its history's band (the quantiles of the baseline runs per step bucket), one
    panel per metric the band and the run both have."""
    if data.band is None:
        return []
    runs = data.band.run_ids
    q = data.band.quantiles
    own: dict[str, tuple[list[int], list[float | None]]] = {m: column(data.steps, m) for m in BAND_METRICS}
    for split in {e["split"] for e in data.evals}:
        own[f"eval_loss/{split}"] = series(
            [e for e in data.evals if e["split"] == split], lambda e: e["loss"]
        )
    panels = []
    for metric, band in data.band.metrics.items():
        if metric not in own or not any(y is not None for y in own[metric][1]):
            continue
        xs, lo = thin(band.steps, band.lo)
        _, hi = thin(band.steps, band.hi)
        _, mid = thin(band.steps, band.mid)
        title = f"{metric}: this run against {len(runs)} baseline run(s)"
        traces: list[dict[str, Any]] = [
            {
                "type": "scatter",
                "mode": "lines",
                "x": xs,
                "y": lo,
                "name": f"p{q[0] * 100:g}",
                "line": {"width": 0, "color": "rgba(44,160,44,0.3)"},
                "showlegend": False,
            },
            {
                "type": "scatter",
                "mode": "lines",
                "x": xs,
                "y": hi,
                "name": f"baseline p{q[0] * 100:g}–p{q[2] * 100:g}",
                "fill": "tonexty",
                "fillcolor": "rgba(44,160,44,0.2)",
                "line": {"width": 0, "color": "rgba(44,160,44,0.3)"},
            },
            {
                "type": "scatter",
                "mode": "lines",
                "x": xs,
                "y": mid,
                "name": "baseline median",
                "line": {"dash": "dash", "color": "#2ca02c"},
            },
            line("this run", *own[metric], line={"color": "#1f77b4"}),
        ]
        fig = figure(traces, layout(title, metric, log_y=metric == "grad_norm"))
        trace = anomaly_trace([a for a in data.anomalies if a.get("metric") == metric], *own[metric])
        if trace is not None:
            fig["data"].append(trace)
        mark_actions(fig, data.actions, labels=False)
        panels.append(Panel(f"band-{metric.replace('/', '-')}", title, "baselines", fig))
    return panels
