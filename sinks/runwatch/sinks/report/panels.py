"""The report's panels as plotly figures (plain dicts of plotly.js's JSON), built from ``ReportData``.

The Run dashboard's panels against the step (Grafana draws them against time; a report reads better
by step, and a rollback's replay then overlaps the steps it repeats), and the Baselines dashboard's:
the run against its history's band at the same step. Anomalies are marked on the loss curve and on
the curve of their metric; actions are vertical lines on every step panel, a rollback labelled with
its target step. Pure: a unit test drives it with hand-made rows.

The pieces of a figure are ``figures.py``'s, the Run dashboard's panels ``run_panels.py``'s, the Baselines
dashboard's ``band_panels.py``'s; every name is handed on here.
"""

from __future__ import annotations

from runwatch.sinks.report.band_panels import (
    BAND_METRICS,
    band_panels,
)
from runwatch.sinks.report.data import ReportData
from runwatch.sinks.report.figures import (
    ACTION_COLORS,
    ATTEMPT_DASHES,
    GIB,
    MAX_POINTS,
    SEVERITY_COLORS,
    WARMUP_STEPS,
    Figure,
    Panel,
    anomaly_trace,
    attempt_lines,
    finite,
    has_values,
    layout,
    line,
    mark_actions,
    mark_nonfinite,
    no_data,
    nonfinite_steps,
    past_warmup,
    series,
    thin,
    y_at,
)
from runwatch.sinks.report.run_panels import (
    category_panel,
    eval_panel,
    module_heatmap_panel,
    module_lines_panel,
    rank_panel,
    run_panels,
)


def all_panels(data: ReportData) -> list[Panel]:
    return run_panels(data) + band_panels(data)


__all__ = [
    "ACTION_COLORS",
    "ATTEMPT_DASHES",
    "BAND_METRICS",
    "Figure",
    "GIB",
    "MAX_POINTS",
    "Panel",
    "SEVERITY_COLORS",
    "WARMUP_STEPS",
    "all_panels",
    "anomaly_trace",
    "attempt_lines",
    "band_panels",
    "category_panel",
    "eval_panel",
    "finite",
    "has_values",
    "layout",
    "line",
    "mark_actions",
    "mark_nonfinite",
    "module_heatmap_panel",
    "module_lines_panel",
    "no_data",
    "nonfinite_steps",
    "past_warmup",
    "rank_panel",
    "run_panels",
    "series",
    "thin",
    "y_at",
]
