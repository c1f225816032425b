"""The pieces of the report's plotly figures (plain dicts of plotly.js's JSON): a panel, its curves (thinned,
by step, gaps for what is not finite, one trace per attempt), its layout, and the marks of anomalies,
actions and non-finite steps on it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runwatch.contract.action_kinds import ACTION_KINDS

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


def rounded(v: float | None) -> float | None:
    return None if v is None else float(f"{v:.6g}")


def thin(
    xs: Sequence[Any], ys: Sequence[float | None], max_points: int = MAX_POINTS
) -> tuple[list[Any], list[float | None]]:
    """At most about ``max_points`` points of (xs, ys), in order: each of equal buckets keeps its lowest
    and highest value (a spike survives thinning) and a gap (None) if it had one."""
    n = len(xs)
    if n <= max_points:
        return list(xs), [rounded(y) for y in ys]
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
            out_y.append(rounded(ys[i]))
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
        my.append(rounded(y_at(xs, ys, int(step))))
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


def figure(traces: list[dict[str, Any]], lay: dict[str, Any]) -> Figure:
    return {"data": traces, "layout": lay}


def column(
    rows: Sequence[dict[str, Any]], name: str, scale: float = 1.0
) -> tuple[list[int], list[float | None]]:
    def value(row: dict[str, Any]) -> Any:
        v = row.get(name)
        return v / scale if isinstance(v, int | float) and scale != 1.0 else v

    return series(rows, value)
