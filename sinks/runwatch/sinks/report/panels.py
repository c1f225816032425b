"""The report's panels as plotly figures (plain dicts of plotly.js's JSON), built from ``ReportData``.

The Run dashboard's panels against the step (Grafana draws them against time; a report reads better
by step, and a rollback's replay then overlaps the steps it repeats), and the Baselines dashboard's:
the run against its history's band at the same step. Anomalies are marked on the loss curve and on
the curve of their metric; actions are vertical lines on every step panel, a rollback labelled with
its target step. Pure: a unit test drives it with hand-made rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from runwatch.contract.action_kinds import ACTION_KINDS
from runwatch.sinks.report.data import ReportData

MAX_POINTS = 2000  # per trace: a long run is thinned (each bucket's extremes kept), so the file stays small
SEVERITY_COLORS = {"info": "#1f77b4", "warning": "#ff7f0e", "critical": "#d62728"}
ACTION_COLORS = {name: spec.color for name, spec in ACTION_KINDS.items()}
GIB = 1024.0**3

Figure = dict[str, Any]


@dataclass
class Panel:
    """One drawn panel: its id (the HTML element's), title, dashboard section and plotly figure."""

    id: str
    title: str
    section: str  # "run" or "baselines"
    figure: Figure
    note: str = ""
    metrics: list[str] = field(default_factory=list)  # anomaly metrics marked on it


def finite(v: Any) -> float | None:
    """``v`` as a float, or None when absent or not finite (JSON has no NaN; plotly leaves a gap)."""
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _round(v: float | None) -> float | None:
    return None if v is None else float(f"{v:.6g}")


def thin(
    xs: Sequence[Any], ys: Sequence[float | None], max_points: int = MAX_POINTS
) -> tuple[list[Any], list[float | None]]:
    """At most about ``max_points`` points of (xs, ys), in order: each of equal buckets keeps its lowest
    and highest value (a spike survives thinning) and a gap (None) if it had one."""
    n = len(xs)
    if n <= max_points:
        return list(xs), [_round(y) for y in ys]
    size = math.ceil(n / max(1, max_points // 2))
    out_x: list[Any] = []
    out_y: list[float | None] = []
    for start in range(0, n, size):
        idx = range(start, min(n, start + size))
        values = [i for i in idx if ys[i] is not None]
        gaps = [i for i in idx if ys[i] is None]
        keep = set(gaps[:1])
        if values:
            keep.add(min(values, key=lambda i: ys[i]))  # type: ignore[arg-type, return-value]
            keep.add(max(values, key=lambda i: ys[i]))  # type: ignore[arg-type, return-value]
        for i in sorted(keep):
            out_x.append(xs[i])
            out_y.append(_round(ys[i]))
    return out_x, out_y


def series(
    rows: Iterable[dict[str, Any]], value: Callable[[dict[str, Any]], Any]
) -> tuple[list[int], list[float | None]]:
    """(steps, values) of rows in time order. A row without the value is left out (a figure reported
    every N steps draws as one line); a non-finite value is a gap, and so is a step going back (a
    rollback's replay starts a new line instead of drawing one back across the plot)."""
    xs: list[int] = []
    ys: list[float | None] = []
    last: int | None = None
    for row in rows:
        step, raw = row.get("step"), value(row)
        if step is None or raw is None:
            continue
        if last is not None and step < last and ys and ys[-1] is not None:
            xs.append(int(step))
            ys.append(None)
        xs.append(int(step))
        ys.append(finite(raw))
        last = step
    return xs, ys


def line(name: str, xs: Sequence[Any], ys: Sequence[float | None], **extra: Any) -> dict[str, Any]:
    """A curve; markers too when it has few points (a figure reported every N steps)."""
    tx, ty = thin(xs, ys)
    mode = "lines+markers" if len(tx) <= 60 else "lines"
    return {
        "type": "scatter",
        "mode": mode,
        "name": name,
        "x": tx,
        "y": ty,
        "connectgaps": False,
        "marker": {"size": 4},
        **extra,
    }


ATTEMPT_DASHES = ("solid", "dash", "dot", "dashdot", "longdash")


def attempt_lines(
    name: str, rows: Sequence[dict[str, Any]], value: Callable[[dict[str, Any]], Any]
) -> list[dict[str, Any]]:
    """``name``'s curve as one trace per attempt: a rollback's replay (the step going back) starts a trace
    of its own, named for the step it went back to and drawn dashed, so that the steps run again are not
    drawn over the first pass with nothing telling them apart."""
    segments: list[tuple[list[int], list[float | None]]] = [([], [])]
    last: int | None = None
    for row in rows:
        step, raw = row.get("step"), value(row)
        if step is None or raw is None:
            continue
        if last is not None and step < last and segments[-1][0]:
            segments.append(([], []))
        segments[-1][0].append(int(step))
        segments[-1][1].append(finite(raw))
        last = step
    traces = []
    for i, (xs, ys) in enumerate(segments):
        label = name if i == 0 else f"{name} after rollback {i} (from step {xs[0]})"
        dash = ATTEMPT_DASHES[i % len(ATTEMPT_DASHES)]
        traces.append(line(label, xs, ys, line={"dash": dash}, legendgroup=name))
    return traces


def nonfinite_steps(rows: Sequence[dict[str, Any]], names: Sequence[str]) -> list[int]:
    """The steps whose ``names`` value was reported but not finite (NaN, Inf), in order, once each."""
    found = {
        int(row["step"])
        for row in rows
        if row.get("step") is not None
        for n in names
        if row.get(n) is not None and finite(row.get(n)) is None
    }
    return sorted(found)


def mark_nonfinite(fig: Figure, steps: Sequence[int]) -> None:
    """A red band over each run of non-finite steps, labelled at the top of the panel: a NaN has no place
    on a value axis (a marker at 0 or on the last value would mislead), so it is shown over the whole
    height where it happened."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    for run in runs:
        fig["layout"]["shapes"].append(
            {
                "type": "rect",
                "xref": "x",
                "yref": "paper",
                "x0": run[0] - 0.5,
                "x1": run[-1] + 0.5,
                "y0": 0,
                "y1": 1,
                "fillcolor": "rgba(214,39,40,0.18)",
                "line": {"width": 0},
                "layer": "below",
                "name": "nonfinite",
            }
        )
        # ("not finite": the panels' JSON holds no "NaN", which a browser's JSON.parse would refuse)
        label = f"not finite at step {run[0]}" if len(run) == 1 else f"not finite, steps {run[0]}–{run[-1]}"
        fig["layout"]["annotations"].append(
            {
                "text": label,
                "x": run[0],
                "xref": "x",
                "y": 1.06,
                "yref": "paper",
                "xanchor": "left",
                "showarrow": False,
                "font": {"size": 11, "color": "#d62728"},
                "name": "nonfinite",
            }
        )


WARMUP_STEPS = 5  # the first steps (compilation, allocator, caches) are left out of a time axis's range


def past_warmup(fig: Figure) -> None:
    """Fit the y axis to the values after the first ``WARMUP_STEPS`` points when those are far outside
    them (a first step 10x slower squashes the rest of the curve), saying so on the panel."""
    first: list[float] = []
    rest: list[float] = []
    for trace in fig["data"]:
        ys = [y for y in trace.get("y") or [] if y is not None]
        first += ys[:WARMUP_STEPS]
        rest += ys[WARMUP_STEPS:]
    if len(rest) < 10 or fig["layout"]["yaxis"].get("type") == "log":
        return
    low, high = min(rest), max(rest)
    span = (high - low) or abs(high) or 1.0
    if not any(v > high + span or v < low - span for v in first):
        return
    fig["layout"]["yaxis"]["range"] = [low - 0.1 * span, high + 0.1 * span]
    fig["layout"]["annotations"].append(
        {
            "text": f"the first {WARMUP_STEPS} steps (warm-up) are off this scale",
            "xref": "paper",
            "yref": "paper",
            "x": 1,
            "y": 1.06,
            "xanchor": "right",
            "showarrow": False,
            "font": {"size": 11, "color": "#888"},
        }
    )


def has_values(traces: Iterable[dict[str, Any]]) -> bool:
    return any(y is not None for t in traces for y in (t.get("y") or t.get("z") or []))


def layout(title: str, y_title: str = "", log_y: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "height": 360,
        "margin": {"l": 70, "r": 20, "t": 60, "b": 90},
        "xaxis": {"title": {"text": "step"}, "zeroline": False},
        "yaxis": {
            "title": {"text": y_title},
            "type": "log" if log_y else "linear",
            "exponentformat": "power",
        },
        "legend": {"orientation": "h", "y": -0.3, "yanchor": "top"},
        "hovermode": "x unified",
        "shapes": [],
        "annotations": [],
        **extra,
    }


def no_data(fig: Figure, what: str) -> Figure:
    """An empty panel that says so (drawn all the same: a reader sees the panel and why it is empty)."""
    fig["layout"]["annotations"].append(
        {
            "text": f"not reported by this run: {what}",
            "xref": "paper",
            "yref": "paper",
            "x": 0.5,
            "y": 0.5,
            "showarrow": False,
            "font": {"size": 13, "color": "#888"},
        }
    )
    fig["layout"]["xaxis"]["visible"] = False
    fig["layout"]["yaxis"]["visible"] = False
    return fig


def y_at(xs: Sequence[int], ys: Sequence[float | None], step: int) -> float | None:
    """The curve's last finite value at or before ``step`` (its first pass), else the first after it:
    where a marker for ``step`` sits when the value there was not finite."""
    before = [y for x, y in zip(xs, ys, strict=True) if y is not None and x <= step]
    if before:
        return before[-1]
    after = [y for y in ys if y is not None]
    return after[0] if after else None


def anomaly_trace(
    anomalies: Sequence[dict[str, Any]], xs: Sequence[int], ys: Sequence[float | None]
) -> dict[str, Any] | None:
    """The anomalies as red/orange ``x`` markers on a curve, at their value when finite and on the
    curve, else on the curve at their step; hover says what was found."""
    points = [(a, a["step"]) for a in anomalies if a.get("step") is not None]
    if not points:
        return None
    mx, my, colors, texts = [], [], [], []
    for a, step in points:
        mx.append(int(step))
        my.append(_round(y_at(xs, ys, int(step))))
        colors.append(SEVERITY_COLORS.get(a.get("severity", ""), "#d62728"))
        value = finite(a.get("value"))
        shown = (
            "non-finite"
            if a.get("value") is not None and value is None
            else (f"{value:.4g}" if value is not None else "")
        )
        texts.append(
            f"{a['detector']} ({a.get('severity', '')}) {a.get('metric', '')} "
            f"{shown}<br>{a.get('message', '')}"
        )
    return {
        "type": "scatter",
        "mode": "markers",
        "name": "anomalies",
        "x": mx,
        "y": my,
        "text": texts,
        "hovertemplate": "step %{x}<br>%{text}<extra></extra>",
        "marker": {"symbol": "x", "size": 13, "color": colors, "line": {"width": 2, "color": colors}},
    }


def mark_actions(fig: Figure, actions: Sequence[dict[str, Any]], labels: bool = True) -> None:
    """Each action as a vertical line at the step it was taken (the trainer's ack; else where it was
    issued); a rollback labelled with the step it went back to."""
    for i, a in enumerate(actions):
        step = a.get("ack_step") if a.get("ack_step") is not None else a.get("step")
        if step is None:
            continue
        kind = a.get("kind", "")
        color = ACTION_COLORS.get(kind, "#555")
        fig["layout"]["shapes"].append(
            {
                "type": "line",
                "xref": "x",
                "yref": "paper",
                "x0": step,
                "x1": step,
                "y0": 0,
                "y1": 1,
                "line": {"color": color, "width": 1.5, "dash": "solid" if kind == "rollback" else "dot"},
            }
        )
        if not labels:
            continue
        target = a.get("to_step") if a.get("to_step") is not None else a.get("target_step")
        text = f"{kind} → step {target}" if kind == "rollback" and target is not None else kind
        if a.get("outcome") and a["outcome"] != "applied":
            text += f" ({a['outcome']})"
        # staggered, so that actions a few steps apart stay readable
        fig["layout"]["annotations"].append(
            {
                "text": text,
                "x": step,
                "xref": "x",
                "y": 1.0 - 0.08 * (i % 4),
                "yref": "paper",
                "xanchor": "left",
                "yanchor": "top",
                "showarrow": False,
                "bgcolor": "rgba(255,255,255,0.8)",
                "font": {"size": 11, "color": color},
                "name": f"action-{kind}",
            }
        )


def _figure(traces: list[dict[str, Any]], lay: dict[str, Any]) -> Figure:
    return {"data": traces, "layout": lay}


def _step_panel(
    data: ReportData,
    pid: str,
    title: str,
    y_title: str,
    traces: list[dict[str, Any]],
    what: str,
    log_y: bool = False,
    metrics: Sequence[str] = (),
    mark_on: int = 0,
    nonfinite: Sequence[str] = (),
    warmup: bool = False,
) -> Panel:
    """A panel of curves against the step, with the run's actions and the anomalies of ``metrics``
    marked (on trace ``mark_on``); steps where a ``nonfinite`` column was NaN/Inf are banded; ``warmup``:
    the y axis leaves out first steps far off the rest."""
    fig = _figure([t for t in traces if has_values([t])], layout(title, y_title, log_y))
    if not fig["data"]:
        return Panel(pid, title, "run", no_data(fig, what))
    mark_nonfinite(fig, nonfinite_steps(data.steps, nonfinite))
    if warmup:
        past_warmup(fig)
    marked = [a for a in data.anomalies if a.get("metric") in metrics or "*" in metrics]
    base = fig["data"][min(mark_on, len(fig["data"]) - 1)]
    trace = anomaly_trace(marked, base["x"], base["y"])
    if trace is not None:
        fig["data"].append(trace)
    mark_actions(fig, data.actions)
    return Panel(pid, title, "run", fig, metrics=list(metrics))


def _col(
    rows: Sequence[dict[str, Any]], name: str, scale: float = 1.0
) -> tuple[list[int], list[float | None]]:
    def value(row: dict[str, Any]) -> Any:
        v = row.get(name)
        return v / scale if isinstance(v, int | float) and scale != 1.0 else v

    return series(rows, value)


def _nth(values: Sequence[Any] | None, i: int) -> Any:
    return values[i] if values is not None and len(values) > i else None


def _nth_lr(g: int) -> Callable[[dict[str, Any]], Any]:
    """A row's LR of param group ``g`` (None when it has none)."""
    return lambda r: _nth(r.get("lr"), g)


def _category_mean(n: str) -> Callable[[dict[str, Any]], Any]:
    """A parsed row's mean loss of category ``n`` (None when it has none)."""
    return lambda p: (p["cats"].get(n) or {}).get("mean") if isinstance(p["cats"].get(n), dict) else None


def run_panels(data: ReportData) -> list[Panel]:
    """The Run dashboard's panels (rank 0's curves; per-rank step time for a multi-rank run)."""
    s = data.steps
    panels = [
        _step_panel(
            data,
            "loss",
            "Loss (rank 0) with findings and actions",
            "loss",
            attempt_lines("loss", s, lambda r: r.get("loss")),
            "loss",
            metrics=("*",),
            nonfinite=("loss",),
        ),
        _step_panel(
            data,
            "lr",
            "Learning rate",
            "lr",
            [
                line(f"group {g}", *series(s, _nth_lr(g)))
                for g in range(max((len(r.get("lr") or []) for r in s), default=0))
            ],
            "lr",
        ),
        _step_panel(
            data,
            "grad_norm",
            "Grad norm before and after clipping",
            "norm",
            [
                # wide and pale under a thin dashed "after": where clipping did nothing both still show
                line("before clipping", *_col(s, "grad_norm"), line={"width": 4}, opacity=0.45),
                line("after clipping", *_col(s, "grad_norm_clipped"), line={"width": 1.5, "dash": "dash"}),
            ],
            "grad_norm",
            log_y=True,
            metrics=("grad_norm", "grad_norm_clipped"),
            nonfinite=("grad_norm",),
        ),
        _step_panel(
            data,
            "clip_ratio",
            "Clip ratio (after / before)",
            "ratio",
            [line("clip ratio", *_col(s, "clip_ratio"))],
            "clip_ratio",
        ),
        _step_panel(
            data,
            "update_ratio",
            "Update ratio (|update| / |params|)",
            "ratio",
            [line("relative update norm", *_col(s, "relative_update_norm"))],
            "relative_update_norm",
            log_y=True,
            metrics=("relative_update_norm", "update_ratio"),
        ),
        _step_panel(
            data,
            "effective_lr",
            "Effective LR ratio",
            "ratio",
            [line("effective LR ratio", *_col(s, "effective_lr_ratio"))],
            "effective_lr_ratio",
            metrics=("effective_lr_ratio",),
        ),
        module_lines_panel(data),
        module_heatmap_panel(data),
        _step_panel(
            data,
            "step_time",
            "Step time (rank 0)",
            "seconds",
            [line("step time", *_col(s, "step_time_s")), line("compute", *_col(s, "compute_s"))],
            "step_time_s",
            metrics=("step_time_s", "step_time"),
            warmup=True,
        ),
        _step_panel(
            data,
            "throughput",
            "Throughput",
            "per second",
            [line("samples/s", *_col(s, "samples_per_s")), line("tokens/s", *_col(s, "tokens_per_s"))],
            "samples_per_s, tokens_per_s",
            metrics=("samples_per_s", "tokens_per_s", "throughput"),
            warmup=True,
        ),
        _step_panel(
            data, "mfu", "MFU", "fraction of peak", [line("MFU", *_col(s, "mfu"))], "mfu", metrics=("mfu",)
        ),
        _step_panel(
            data,
            "data_wait",
            "Data wait",
            "seconds",
            [line("data wait", *_col(s, "data_wait_s"))],
            "data_wait_s",
            metrics=("data_wait_s",),
        ),
        _step_panel(
            data,
            "memory",
            "Memory",
            "GiB",
            [
                line(name, *_col(s, f"memory_{name.replace(' ', '_')}", GIB))
                for name in ("allocated", "reserved", "peak", "host rss")
            ],
            "memory",
            metrics=(
                "memory_allocated",
                "memory_reserved",
                "memory_peak",
                "memory_host_rss",
                "fragmentation",
                "memory",
            ),
        ),
        category_panel(data),
        eval_panel(data),
    ]
    if data.rank_step_times:
        panels.append(rank_panel(data))
    return panels


def module_lines_panel(data: ReportData) -> Panel:
    by_module: dict[str, list[dict[str, Any]]] = {}
    for row in data.modules:
        by_module.setdefault(row["module"], []).append(row)
    traces = [line(name, *series(rows, lambda r: r["norm"])) for name, rows in by_module.items()]
    return _step_panel(
        data,
        "modules",
        f"Per-module grad norms (top {len(traces)})",
        "norm",
        traces,
        "module_grad_norms",
        log_y=True,
        metrics=tuple(f"module_grad_norm/{m}" for m in by_module) + tuple(by_module),
    )


def module_heatmap_panel(data: ReportData) -> Panel:
    title = f"Per-module grad norm, log10 (max per {data.heatmap_bucket_steps} steps)"
    modules = sorted({r["module"] for r in data.heatmap})
    steps = sorted({r["step"] for r in data.heatmap})
    fig = _figure([], layout(title, ""))
    if not modules:
        return Panel("module_heatmap", title, "run", no_data(fig, "module_grad_norms"))
    col = {s: i for i, s in enumerate(steps)}
    row = {m: i for i, m in enumerate(modules)}
    z: list[list[float | None]] = [[None] * len(steps) for _ in modules]
    for r in data.heatmap:
        v = finite(r["norm"])
        z[row[r["module"]]][col[r["step"]]] = _round(math.log10(v)) if v is not None and v > 0 else None
    fig["data"].append(
        {
            "type": "heatmap",
            "x": steps,
            "y": modules,
            "z": z,
            "colorscale": "Viridis",
            "colorbar": {"title": {"text": "log10"}},
            "hoverongaps": False,
        }
    )
    fig["layout"]["height"] = max(300, 18 * len(modules) + 100)
    fig["layout"]["hovermode"] = "closest"
    fig["layout"]["yaxis"].update(type="category", automargin=True)
    mark_actions(fig, data.actions, labels=False)
    return Panel("module_heatmap", title, "run", fig)


def category_panel(data: ReportData) -> Panel:
    parsed = []
    for r in data.steps:
        cats = orjson.loads(r["category_loss"]) if r.get("category_loss") else {}
        parsed.append({"step": r["step"], "cats": cats if isinstance(cats, dict) else {}})
    names = sorted({c for p in parsed for c in p["cats"]})
    traces = [
        line(
            name,
            *series(parsed, _category_mean(name)),
        )
        for name in names
    ]
    return _step_panel(
        data,
        "category_loss",
        "Per-category loss",
        "mean loss",
        traces,
        "category_loss",
        metrics=tuple(f"category_loss/{n}" for n in names) + ("category_loss",),
    )


def eval_panel(data: ReportData) -> Panel:
    traces = []
    for split in sorted({e["split"] for e in data.evals}):
        rows = [e for e in data.evals if e["split"] == split]
        traces.append(line(f"{split} loss", *series(rows, lambda e: e["loss"]), mode="lines+markers"))
        metrics = [orjson.loads(e["metrics"]) if e.get("metrics") else {} for e in rows]
        for name in sorted({k for m in metrics for k in m}):
            traces.append(
                line(
                    f"{split} {name}",
                    *series(
                        [{"step": e["step"], "v": m.get(name)} for e, m in zip(rows, metrics, strict=True)],
                        lambda r: r["v"],
                    ),
                    mode="lines+markers",
                    yaxis="y2",
                )
            )
    panel = _step_panel(
        data, "eval", "Eval metrics", "loss", traces, "eval events", metrics=("eval_loss", "val_loss", "eval")
    )
    if any(t.get("yaxis") == "y2" for t in panel.figure["data"]):
        panel.figure["layout"]["yaxis2"] = {"overlaying": "y", "side": "right", "title": {"text": "metric"}}
    return panel


def rank_panel(data: ReportData) -> Panel:
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in data.rank_step_times:
        by_rank.setdefault(r["rank"], []).append(r)
    traces = [
        line(f"rank {rank}", *series(rows, lambda r: r["step_time_s"]))
        for rank, rows in sorted(by_rank.items())
    ]
    return _step_panel(
        data,
        "rank_step_time",
        "Step time per rank",
        "seconds",
        traces,
        "per-rank step time",
        metrics=("straggler", "step_time_skew"),
    )


# -- the Baselines dashboard ------------------------------------------------------------------------

BAND_METRICS = ("loss", "grad_norm", "step_time_s", "memory_allocated", "memory_peak", "memory_host_rss")


def band_panels(data: ReportData) -> list[Panel]:
    """The run against its history's band (the quantiles of the baseline runs per step bucket), one
    panel per metric the band and the run both have."""
    if data.band is None:
        return []
    runs = data.band.run_ids
    q = data.band.quantiles
    own: dict[str, tuple[list[int], list[float | None]]] = {m: _col(data.steps, m) for m in BAND_METRICS}
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
        fig = _figure(traces, layout(title, metric, log_y=metric == "grad_norm"))
        trace = anomaly_trace([a for a in data.anomalies if a.get("metric") == metric], *own[metric])
        if trace is not None:
            fig["data"].append(trace)
        mark_actions(fig, data.actions, labels=False)
        panels.append(Panel(f"band-{metric.replace('/', '-')}", title, "baselines", fig))
    return panels


def all_panels(data: ReportData) -> list[Panel]:
    return run_panels(data) + band_panels(data)
