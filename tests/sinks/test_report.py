"""`runwatch report` as a person sees it: the HTML of a real `nan` demo run (embedded broker, Faust worker,
real torch, chdb) and of a two-rank run with a baseline history, opened in headless Chromium over the
DevTools protocol: no console errors, every panel drew, the non-finite finding and the rollback marked
on the loss curve, under 5 MB. Screenshots are kept (their paths are printed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.support.chromium import Browser

pytestmark = pytest.mark.integration

STEPS = 160
MAX_BYTES = 5_000_000
DRAWN = "document.body && (document.body.dataset.drawn || document.body.dataset.error)"
# per panel element: how many plotly SVG layers it drew (plotly adds .main-svg to every plot it draws)
PANELS_DRAWN = (
    "Array.from(document.querySelectorAll('.panel')).map(p => "
    "[p.dataset.panel, p.querySelectorAll('.main-svg').length, !!p.querySelector('.plot-container')])"
)


def runwatch(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RUNWATCH_BOOTSTRAP", "RUNWATCH_CLICKHOUSE_DSN") and not k.startswith("RUNWATCH_ACTION_")
    }
    return subprocess.run(
        [sys.executable, "-m", "runwatch.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def nan_demo(tmp_path_factory) -> tuple[Path, dict]:
    """A real `runwatch demo --scenario nan` run (its own working directory and chdb path)."""
    cwd = tmp_path_factory.mktemp("report-demo")
    proc = runwatch(cwd, "demo", "--scenario", "nan", "--steps", str(STEPS), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd, json.loads(proc.stdout)


def open_report(chromium: str, path: Path, shot: Path) -> dict:
    """Open ``path`` in headless Chromium; what the page drew, its console errors, and a screenshot."""
    with Browser(chromium) as browser:
        drawn = browser.open(path.resolve().as_uri(), DRAWN, timeout=90)
        page = {
            "drawn": drawn,
            "error": browser.evaluate("document.body.dataset.error || null"),
            "expected": int(browser.evaluate("document.body.dataset.panels")),
            "panels": browser.evaluate(PANELS_DRAWN),
            "loss_annotations": browser.evaluate(
                "Array.from(document.querySelectorAll('#panel-loss .annotation-text'))"
                ".map(a => a.textContent)"
            ),
            # plotly keeps the figure on its element: the anomaly markers it drew on the loss curve
            "loss_markers": browser.evaluate(
                "(document.getElementById('panel-loss').data || []).filter(t => t.name === 'anomalies')"
                ".map(t => t.x)"
            ),
            "loss_marker_points": browser.evaluate(
                "document.querySelectorAll('#panel-loss .scatterlayer .trace:last-child .point').length"
            ),
            "findings": browser.evaluate(
                "Array.from(document.querySelectorAll('table.findings tbody tr')).map(r => r.innerText)"
            ),
            "text": browser.evaluate("document.body.innerText"),
        }
        browser.screenshot(shot)
        page["console_errors"] = list(browser.console_errors)
    print(f"\nreport screenshot: {shot}")
    return page


def assert_drawn(page: dict) -> None:
    assert page["console_errors"] == []
    assert page["error"] is None
    assert int(page["drawn"]) == page["expected"] == len(page["panels"])
    undrawn = [name for name, svgs, container in page["panels"] if svgs < 1 or not container]
    assert not undrawn, f"panels that did not draw: {undrawn}"


def test_the_nan_demo_report_draws_the_finding_and_the_rollback_on_the_loss_curve(
    nan_demo, chromium, tmp_path_factory
):
    cwd, demo = nan_demo
    path = Path(demo["report"])
    assert path.is_file() and path.is_relative_to(cwd)
    assert path.stat().st_size < MAX_BYTES
    html = path.read_text()
    assert "<script src=" not in html and "cdn.plot.ly" not in html  # nothing fetched to view it

    page = open_report(chromium, path, tmp_path_factory.mktemp("screenshots") / "report-nan.png")
    assert_drawn(page)
    names = {name for name, _, _ in page["panels"]}
    assert {
        "loss",
        "lr",
        "grad_norm",
        "modules",
        "module_heatmap",
        "step_time",
        "throughput",
        "mfu",
        "data_wait",
        "memory",
        "category_loss",
        "eval",
    } <= names
    fault = demo["fault_step"]
    (rollback,) = demo["rollbacks"]
    # the non-finite finding is a marker on the loss curve at its step, and the rollback a labelled line
    assert page["loss_markers"] and fault in page["loss_markers"][0]
    assert page["loss_marker_points"] >= 1
    assert f"rollback → step {rollback['to_step']}" in page["loss_annotations"]
    assert any("non_finite" in row and str(fault) in row for row in page["findings"])
    assert "no baseline history" in page["text"]  # the demo run has no baseline key, and says so


def test_report_command_on_the_demo_data(nan_demo):
    cwd, demo = nan_demo
    proc = runwatch(cwd, "report", demo["run_id"])  # default DSN (the demo's) and default --out
    assert proc.returncode == 0, proc.stderr
    out = cwd / f"report-{demo['run_id']}.html"
    assert out.is_file() and str(out) in proc.stdout
    assert 0 < out.stat().st_size < MAX_BYTES

    unknown = runwatch(cwd, "report", "no-such-run")
    assert unknown.returncode == 2 and "unknown run 'no-such-run'" in unknown.stderr
    unreachable = runwatch(cwd, "report", demo["run_id"], "--dsn", "http://127.0.0.1:9")
    assert unreachable.returncode == 2 and "ClickHouse at http://127.0.0.1:9" in unreachable.stderr


# -- a two-rank run of a job with history: the Baselines panels and per-rank step time -------------------


def _run_events(run_id: str, start: datetime, step_time: float, ranks: int = 2, steps: int = 60) -> list:
    from runwatch.contract.schema import MemoryStats, RunEndEvent, RunStartEvent, StepEvent

    events: list = [
        RunStartEvent(
            run_id=run_id,
            ts=start,
            baseline_key="report-job",
            world_size=ranks,
            git_sha=f"{abs(hash(run_id)) % 16**12:012x}",
            host="node-1",
        )
    ]
    for step in range(1, steps + 1):
        for rank in range(ranks):
            slow = 1.3 if rank == 1 else 1.0  # rank 1 straggles
            events.append(
                StepEvent(
                    run_id=run_id,
                    rank=rank,
                    step=step,
                    ts=start + timedelta(seconds=step, milliseconds=rank),
                    loss=2.0 / (1 + 0.05 * step),
                    lr=[1e-3],
                    grad_norm=1.0 + 0.01 * step,
                    step_time_s=step_time * slow,
                    samples_per_s=64 / (step_time * slow),
                    module_grad_norms={"encoder": 0.5, "head": 0.8 + 0.001 * step},
                    memory=MemoryStats(allocated=2_000_000_000 + 1_000_000 * step, host_rss=3_000_000_000),
                )
            )
    events.append(RunEndEvent(run_id=run_id, ts=start + timedelta(seconds=steps + 1)))
    return events


def test_a_multi_rank_run_against_its_baseline_band(chdb_dsn, chromium, tmp_path_factory):
    from runwatch.sinks import ClickHouseSink
    from runwatch.sinks.report import write_report
    from runwatch.sinks.summaries import summarize_stored_run

    sink = ClickHouseSink(chdb_dsn)
    sink.migrate()
    now = datetime.now(UTC).replace(microsecond=0)
    history = [f"report-hist-{i}" for i in range(6)]
    for i, run_id in enumerate(history):
        sink.writer.write_events(
            _run_events(run_id, now - timedelta(days=6 - i), step_time=0.10 + 0.002 * (i % 3))
        )
    sink.writer.write_events(_run_events("report-slow", now, step_time=0.16))  # 60% slower than its history
    for run_id in [*history, "report-slow"]:
        summarize_stored_run(sink, run_id)

    out = tmp_path_factory.mktemp("report-band") / "slow.html"
    result = write_report(sink, "report-slow", out)
    assert result.bytes < MAX_BYTES
    assert {"rank_step_time", "band-loss", "band-step_time_s"} <= set(result.panels)

    page = open_report(chromium, out, out.with_suffix(".png"))
    assert_drawn(page)
    assert "A run of 2 ranks" in page["text"]
    assert "OUTLIER" in page["text"] and "step_time" in page["text"]
