"""The history corpus' scoring helpers, on synthetic run summaries (no training, no files)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from runwatch.detectors.baselines.compare import BaselineConfig
from runwatch.detectors.baselines.summary import RunSummary
from runwatch.detectors.offline.history_eval import _range_contains, gate_every_run

T0 = datetime(2025, 3, 3, 21, tzinfo=UTC)


def _run(i: int, step_time: float, fingerprint: str = "a") -> RunSummary:
    return RunSummary(
        run_id=f"r{i:02d}",
        baseline_key="job",
        git_sha=f"sha{i}",
        fingerprint=fingerprint,
        started_at=T0 + timedelta(days=i),
        status="completed",
        metrics={"step_time_median_s": step_time},
    )


def test_range_contains_on_a_linear_history() -> None:
    order = {"a": 0, "b": 1, "c": 2, "d": 3}
    assert _range_contains(order, "a", "c", "b")
    assert _range_contains(order, "a", "c", "c")
    assert not _range_contains(order, "b", "d", "b")  # A..B excludes A
    assert _range_contains(order, None, "b", "a")  # no last normal run: everything up to B
    assert not _range_contains(order, "a", "zzz", "b")


def test_every_run_is_judged_against_the_runs_before_it_only() -> None:
    runs = [_run(i, 0.30 + 0.001 * (i % 3)) for i in range(6)] + [_run(6, 0.36)]
    reports = gate_every_run(list(reversed(runs)), BaselineConfig())  # any input order: start order decides
    assert [reports[f"r{i:02d}"].insufficient_history for i in range(6)] == [True] * 5 + [False]
    assert reports["r06"].outliers == ["step_time_median_s"]
    assert reports["r06"].last_normal_sha == "sha5"


def test_another_fingerprint_has_its_own_history() -> None:
    runs = [_run(i, 0.30) for i in range(6)] + [_run(6, 0.24, fingerprint="b")]
    reports = gate_every_run(runs, BaselineConfig())
    assert reports["r06"].insufficient_history and not reports["r06"].outliers
