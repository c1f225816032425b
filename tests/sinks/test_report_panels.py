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
                "onset_step": 3,
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
    shapes = loss.figure["layout"]["shapes"]
    assert [s["x0"] for s in shapes if s.get("name") != "nonfinite"] == [7]  # where the trainer took it
    # the NaN step is a band over the panel's height, labelled at its top (not a point at 0)
    [band] = [s for s in shapes if s.get("name") == "nonfinite"]
    assert (band["x0"], band["x1"], band["yref"], band["y0"], band["y1"]) == (4.5, 5.5, "paper", 0, 1)
    assert "not finite at step 5" in [a["text"] for a in loss.figure["layout"]["annotations"]]


def test_an_unreported_figure_is_a_panel_that_says_so_and_no_baseline_is_said():
    panels = {p.id: p for p in all_panels(data())}
    assert "not reported by this run: mfu" in panels["mfu"].figure["layout"]["annotations"][0]["text"]
    html = render(data(), list(panels.values()))
    assert "no baseline history" in html and 'id="panel-mfu"' in html
    assert "NaN" not in html.split('id="runwatch-panels"')[1]  # JSON has no NaN: the browser would refuse it


def test_the_steps_run_again_after_a_rollback_are_a_trace_of_their_own():
    loss = next(p for p in all_panels(data()) if p.id == "loss")
    curves = [t for t in loss.figure["data"] if t["name"] != "anomalies"]
    assert [t["name"] for t in curves] == ["loss", "loss after rollback 1 (from step 3)"]
    assert [t["line"]["dash"] for t in curves] == ["solid", "dash"]
    assert curves[1]["x"][0] == 3 and 5 in curves[0]["x"]  # the first pass keeps its steps, NaN included


def test_a_time_axis_leaves_out_the_warm_up_steps_that_would_squash_it():
    from runwatch.sinks.report.panels import layout, line, past_warmup

    slow_start = [12.0, 3.0, 1.6] + [1.5 + 0.01 * (i % 7) for i in range(40)]
    fig = {"data": [line("step time", list(range(43)), slow_start)], "layout": layout("Step time")}
    past_warmup(fig)
    low, high = fig["layout"]["yaxis"]["range"]
    assert 1.4 < low < 1.5 and 1.56 < high < 1.7  # the steady steps fill the panel
    assert any("warm-up" in a["text"] for a in fig["layout"]["annotations"])
    steady = {"data": [line("step time", list(range(43)), slow_start[3:])], "layout": layout("Step time")}
    past_warmup(steady)
    assert "range" not in steady["layout"]["yaxis"]  # nothing off scale: plotly's own range


def test_the_demo_says_what_happened_and_what_to_open_next():
    from runwatch.demo.console import closing_lines

    report = {
        "rollbacks": [{"from_step": 159, "to_step": 125, "lr_scale": 0.5}],
        "actions": [
            {"kind": "alert", "step": 150, "action_id": "a", "reason": "loss spike"},
            {"kind": "rollback", "step": 159, "action_id": "b", "reason": "loss spike"},
            {"kind": "recovered", "step": 177, "action_id": "c", "reason": "the run recovered ..."},
        ],
        "steps": 300,
        "steps_completed": 300,
        "steps_executed": 334,
        "stopped": False,
        "report": "/tmp/report-demo.html",
    }
    assert closing_lines(report) == [
        "runwatch rolled the run back at step 159 to the checkpoint of step 125 at 0.5x the LR",
        "at step 177 the run was back at its loss before the fault: the rollback worked",
        "the run completed at step 300 of 300, after 334 executed steps "
        "(34 of them run again after a rollback)",
        "next: open the report, /tmp/report-demo.html (findings, actions, every curve)",
        "then watch your own loop: runwatch up, and examples/quickstart.py (docs/local-stack.md)",
    ]


def test_the_baselines_section_says_why_there_is_no_baseline_once():
    report = data(baseline_note="no baseline history: the run names no baseline_key")
    html = render(report, all_panels(report))
    assert html.count("no baseline history: the run names no baseline_key") == 1


def test_the_findings_table_says_since_which_step():
    from runwatch.sinks.report.html import findings_table

    table = findings_table(data())
    assert "<th>since step</th>" in table and "<td>5</td><td>3</td>" in table
