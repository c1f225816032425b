"""``runwatch report``: one run's dashboards (the Run and Baselines panels), findings, actions and baseline
verdicts as one self-contained HTML file, drawn with plotly.js inlined (nothing is fetched to view it)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from runwatch.sinks.report.data import ReportData, UnknownRun, collect
from runwatch.sinks.report.html import render
from runwatch.sinks.report.panels import Panel, all_panels

if TYPE_CHECKING:
    from runwatch.detectors.baselines.compare import BaselineConfig
    from runwatch.sinks.clickhouse import ClickHouseSink

MAX_BYTES = 5_000_000  # the budget a report is held to (tests/sinks/test_report.py)

__all__ = [
    "MAX_BYTES",
    "Panel",
    "ReportData",
    "ReportResult",
    "UnknownRun",
    "build_report",
    "default_out",
    "write_report",
]


@dataclass
class ReportResult:
    """A written report: where, how big, which panels."""

    path: Path
    bytes: int
    panels: list[str]


def default_out(run_id: str) -> Path:
    """``report-<run_id>.html`` in the working directory."""
    return Path(f"report-{run_id}.html")


def build_report(
    sink: ClickHouseSink, run_id: str, config: BaselineConfig | None = None
) -> tuple[str, list[Panel]]:
    """The report of ``run_id`` as HTML text, and its panels; raises ``UnknownRun``."""
    data = collect(sink, run_id, config, now=datetime.now(UTC))
    panels = all_panels(data)
    return render(data, panels), panels


def write_report(
    sink: ClickHouseSink, run_id: str, out: Path | None = None, config: BaselineConfig | None = None
) -> ReportResult:
    """Write the report of ``run_id`` to ``out`` (default ``default_out``); raises ``UnknownRun``."""
    text, panels = build_report(sink, run_id, config)
    path = Path(out) if out is not None else default_out(run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode()
    path.write_bytes(data)
    return ReportResult(path=path.resolve(), bytes=len(data), panels=[p.id for p in panels])
