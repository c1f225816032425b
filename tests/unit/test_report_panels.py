"""The report's panels from hand-made rows (sinks/runwatch/sinks/report/panels.py, html.py): pure, no
ClickHouse."""

from __future__ import annotations

import math

from runwatch.sinks.report.data import ReportData
from runwatch.sinks.report.html import render
from runwatch.sinks.report.panels import all_panels, series, thin


def data(**overrides) -> ReportData:
    steps = [
        {
            "step": s,
            "loss": (math.nan if s == 5 else 1.0 / s),
            "lr": [1e-3],
            "grad_norm": 1.0,
            "category_loss": '{"a": {"mean": 0.5, "count": 3}}',
        }
        for s in range(1, 9)
    ]
    steps += [
        {"step": s, "loss": 0.9 / s, "lr": [5e-4], "grad_norm": 1.0, "category_loss": None}
        for s in range(3, 9)
    ]
    fields = dict(
        run_id="r1",
        info={"events": 20, "first_ts": None, "last_ts": None, "ranks": 1, "last_step": 8},
        run_start={},
        run_end=None,
        steps=steps,
        rank_step_times=[],
        modules=[],
        heatmap=[],
        heatmap_bucket_steps=1,
        evals=[],
        anomalies=[
            {
                "step": 5,
                "rank": 0,
                "detector": "non_finite",
                "metric": "loss",
                "value": math.nan,
                "threshold": 3.0,
                "severity": "critical",
                "message": "non-finite loss",
            }
        ],
        actions=[
            {
                "action_id": "a",
                "kind": "rollback",
                "reason": "nan",
                "step": 6,
                "onset_step": 5,
                "target_step": 2,
                "issued_at": None,
                "outcome": "applied",
                "ack_step": 7,
                "to_step": 2,
            }
        ],
        baseline_note="no baseline history: this run has no baseline key",
    )
    fields.update(overrides)
    return ReportData(**fields)


def test_a_rollback_replay_and_a_non_finite_value_are_gaps():
    xs, ys = series(data().steps, lambda r: r["loss"])
    assert ys[4] is None and xs[4] == 5  # the NaN at step 5
    assert xs[8:10] == [3, 3] and ys[8] is None  # the step goes back: a gap, then the replay


def test_thinning_keeps_a_spike_and_bounds_the_points():
    xs = list(range(100_000))
    ys = [1.0] * 100_000
    ys[54_321] = 1e6
    tx, ty = thin(xs, ys, max_points=1000)
    assert len(tx) <= 1000 and 1e6 in ty and 54_321 in tx


def test_the_loss_panel_marks_the_finding_and_the_rollback():
    loss = next(p for p in all_panels(data()) if p.id == "loss")
    (markers,) = [t for t in loss.figure["data"] if t["name"] == "anomalies"]
    assert markers["x"] == [5] and markers["y"][0] is not None  # on the curve, though the value was NaN
    assert "rollback → step 2" in [a["text"] for a in loss.figure["layout"]["annotations"]]
    assert [s["x0"] for s in loss.figure["layout"]["shapes"]] == [7]  # where the trainer took it


def test_an_unreported_figure_is_a_panel_that_says_so_and_no_baseline_is_said():
    panels = {p.id: p for p in all_panels(data())}
    assert "not reported by this run: mfu" in panels["mfu"].figure["layout"]["annotations"][0]["text"]
    html = render(data(), list(panels.values()))
    assert "no baseline history" in html and 'id="panel-mfu"' in html
    assert "NaN" not in html.split('id="runwatch-panels"')[1]  # JSON has no NaN: the browser would refuse it
