"""The Run dashboard's panels against the step: loss, LR, gradients, updates, time, memory, modules,
categories, evals and per-rank step time, each with the run's actions and its metric's anomalies marked."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from runwatch.sinks.report.data import ReportData
from runwatch.sinks.report.figures import (
    GIB,
    Panel,
    anomaly_trace,
    attempt_lines,
    column,
    figure,
    finite,
    has_values,
    layout,
    line,
    mark_actions,
    mark_nonfinite,
    no_data,
    nonfinite_steps,
    past_warmup,
    rounded,
    series,
)


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
    fig = figure([t for t in traces if has_values([t])], layout(title, y_title, log_y))
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
                line("before clipping", *column(s, "grad_norm"), line={"width": 4}, opacity=0.45),
                line("after clipping", *column(s, "grad_norm_clipped"), line={"width": 1.5, "dash": "dash"}),
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
            [line("clip ratio", *column(s, "clip_ratio"))],
            "clip_ratio",
        ),
        _step_panel(
            data,
            "update_ratio",
            "Update ratio (|update| / |params|)",
            "ratio",
            [line("relative update norm", *column(s, "relative_update_norm"))],
            "relative_update_norm",
            log_y=True,
            metrics=("relative_update_norm", "update_ratio"),
        ),
        _step_panel(
            data,
            "effective_lr",
            "Effective LR ratio",
            "ratio",
            [line("effective LR ratio", *column(s, "effective_lr_ratio"))],
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
            [line("step time", *column(s, "step_time_s")), line("compute", *column(s, "compute_s"))],
            "step_time_s",
            metrics=("step_time_s", "step_time"),
            warmup=True,
        ),
        _step_panel(
            data,
            "throughput",
            "Throughput",
            "per second",
            [line("samples/s", *column(s, "samples_per_s")), line("tokens/s", *column(s, "tokens_per_s"))],
            "samples_per_s, tokens_per_s",
            metrics=("samples_per_s", "tokens_per_s", "throughput"),
            warmup=True,
        ),
        _step_panel(
            data, "mfu", "MFU", "fraction of peak", [line("MFU", *column(s, "mfu"))], "mfu", metrics=("mfu",)
        ),
        _step_panel(
            data,
            "data_wait",
            "Data wait",
            "seconds",
            [line("data wait", *column(s, "data_wait_s"))],
            "data_wait_s",
            metrics=("data_wait_s",),
        ),
        _step_panel(
            data,
            "memory",
            "Memory",
            "GiB",
            [
                line(name, *column(s, f"memory_{name.replace(' ', '_')}", GIB))
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
    fig = figure([], layout(title, ""))
    if not modules:
        return Panel("module_heatmap", title, "run", no_data(fig, "module_grad_norms"))
    col = {s: i for i, s in enumerate(steps)}
    row = {m: i for i, m in enumerate(modules)}
    z: list[list[float | None]] = [[None] * len(steps) for _ in modules]
    for r in data.heatmap:
        v = finite(r["norm"])
        z[row[r["module"]]][col[r["step"]]] = rounded(math.log10(v)) if v is not None and v > 0 else None
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
