"""The CI gate's judgement: which runs are a run's history, its verdicts, the last normal run, the reports."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

from runwatch.detectors.baselines.check import (
    EXIT_NORMAL,
    EXIT_OUTLIER,
    Commit,
    CommitRange,
    check_run,
    render_markdown,
    render_table,
    select_history,
)
from runwatch.detectors.baselines.compare import BaselineConfig
from runwatch.detectors.baselines.summary import RunSummary

T0 = datetime(2025, 3, 1, tzinfo=UTC)
CONFIG = BaselineConfig()


def run(
    i: int,
    step_time: float = 0.2,
    *,
    day: float | None = None,
    key: str = "job",
    fingerprint: str = "fp",
    status: str = "completed",
    new_baseline: bool = False,
    peak: float = 4e9,
) -> RunSummary:
    return RunSummary(
        run_id=f"r{i:02d}",
        baseline_key=key,
        git_sha=f"{i:02d}" * 20,
        fingerprint=fingerprint,
        started_at=T0 + timedelta(days=i if day is None else day),
        status=status,
        new_baseline=new_baseline,
        metrics={"step_time_median_s": step_time, "max_cuda_peak_bytes": peak, "steps": 100.0},
    )


def steady(n: int, seed: int = 0) -> list[RunSummary]:
    rng = random.Random(seed)
    return [run(i, 0.2 * (1 + rng.gauss(0, 0.01))) for i in range(n)]


def ids(runs: list[RunSummary]) -> list[str]:
    return [r.run_id for r in runs]


def test_history_is_the_same_key_and_hardware_completed_earlier_and_in_the_window():
    this = run(40)
    candidates = [
        run(5),  # 35 days before: outside the 30-day window
        run(12),
        run(20),
        run(21, key="other"),
        run(22, fingerprint="fp2"),
        run(23, status="failed"),
        run(24, status="died"),
        run(41),  # after the run
        this,  # itself
    ]
    assert ids(select_history(this, candidates, CONFIG)) == ["r12", "r20"]
    assert ids(select_history(this, candidates, BaselineConfig(window_days=50))) == ["r05", "r12", "r20"]
    assert select_history(run(40, key=None), candidates, CONFIG) == []  # type: ignore[arg-type]


def test_a_declared_new_baseline_starts_the_history_and_has_none_itself():
    candidates = [run(i) for i in range(10)] + [run(10, new_baseline=True)] + [run(i) for i in range(11, 15)]
    assert ids(select_history(run(15), candidates, CONFIG)) == ["r10", "r11", "r12", "r13", "r14"]
    declaring = candidates[10]
    assert select_history(declaring, candidates, CONFIG) == []
    report = check_run(declaring, candidates, CONFIG)
    assert report.history_size == 0 and report.insufficient_history and report.exit_code == EXIT_NORMAL
    assert {c.verdict for c in report.comparisons} == {"insufficient_history"}
    assert report.baseline_declared_by == "r10"
    assert check_run(run(15), candidates, CONFIG).baseline_declared_by == "r10"


def test_a_normal_run_passes_and_names_the_most_recent_run_as_last_normal():
    history = steady(10)
    report = check_run(run(10, 0.201), history, CONFIG)
    assert report.exit_code == EXIT_NORMAL and report.outliers == []
    assert (
        report.history_size == 10 and report.last_normal_run == "r09" and report.last_normal_sha == "09" * 20
    )
    assert {c.metric for c in report.comparisons} == {
        "step_time_median_s",
        "max_cuda_peak_bytes",
    }  # steps: not judged


def test_a_slower_run_is_an_outlier_and_the_last_normal_run_skips_runs_already_regressed():
    history = steady(10) + [run(10, 0.24), run(11, 0.241)]  # the regression landed at r10
    report = check_run(run(12, 0.242), history, CONFIG)
    assert report.exit_code == EXIT_OUTLIER and report.outliers == ["step_time_median_s"]
    assert report.last_normal_run == "r09"  # not r11, which is itself outside the band
    (step,) = [c for c in report.comparisons if c.metric == "step_time_median_s"]
    assert step.verdict == "OUTLIER" and step.n == 12 and step.low < 0.2 < step.high < 0.242


def test_too_little_history_says_so_and_is_never_normal():
    report = check_run(run(3), steady(3), CONFIG)
    assert report.insufficient_history and report.exit_code == EXIT_NORMAL
    assert all(c.verdict == "insufficient_history" for c in report.comparisons)
    assert "insufficient history (3 run(s)" in render_table(report)


def test_the_renderers_show_the_table_and_the_commit_range():
    report = check_run(run(10, 0.25), steady(10), CONFIG)
    commits = CommitRange(
        from_sha="09" * 20, to_sha="10" * 20, commits=[Commit(sha="ab" * 20, subject="slower data loader")]
    )
    text = render_table(report, commits)
    assert "metric" in text and "baseline median" in text and "OUTLIER" in text
    assert "step_time_median_s  0.25" in text.replace("   ", "  ")
    assert "abababababab slower data loader" in text and "commits 090909090909..101010101010" in text
    md = render_markdown(report, commits)
    assert "| metric | last | baseline median | band | n | verdict | change | spread |" in md
    assert "🔴 OUTLIER" in md and "- `abababababab` slower data loader" in md
    data = json.loads(report.model_dump_json())
    assert data["exit_code"] == 1 and data["outliers"] == ["step_time_median_s"]
    assert (
        data["comparisons"][0]["metric"] == "step_time_median_s"
        and data["comparisons"][0]["verdict"] == "OUTLIER"
    )
    unknown = CommitRange(from_sha=None, to_sha="10" * 20, note="no last normal run")
    assert "(no last normal run)" in render_table(report, unknown)
