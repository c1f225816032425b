"""Goodput's pure parts (issue 39): the per-attempt sums combined into a partition of the wall time, the
baseline check's goodput verdict in points, and the rules that name a host that keeps failing."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from runwatch.detectors.baselines.check import EXIT_NORMAL, EXIT_OUTLIER, check_run
from runwatch.detectors.baselines.compare import GOODPUT_METRIC, BaselineConfig, compare_goodput
from runwatch.detectors.baselines.summary import RunSummary
from runwatch.sinks.goodput import combine
from runwatch.sinks.hosts import LemonHost, count_lemons


def steps_row(attempt, *, last_step, productive, rollback=0.0, wait=0.0, stall=0.0, ckpt=0.0, ev=0.0,
              startup=0.0, other=0.0, stalled_after=False):  # fmt: skip
    # as _STEPS_SQL selects them: attempt, steps, steps_lost, last step ts, then the sums
    return (
        attempt,
        10,
        2,
        last_step,
        rollback,
        wait,
        stall,
        productive,
        ckpt,
        ev,
        startup,
        other,
        stalled_after,
    )


def test_two_attempts_partition_the_wall_time_with_the_gap_between_them():
    attempts = [(1, 100.0, 160.0), (2, 190.0, 250.0)]  # a 30 s restart gap
    steps = {
        1: steps_row(1, last_step=150.0, productive=40.0, rollback=5.0, ckpt=2.0, startup=3.0),  # 10 s tail
        2: steps_row(2, last_step=250.0, productive=50.0, wait=4.0, stall=5.0, startup=1.0),
    }
    g = combine("r", attempts, steps)
    assert g.wall_s == 150.0 and g.restart_gap_s == 30.0 and g.attempts == 2
    assert g.other_s == 10.0  # the first attempt's time after its last step, no stall finding in it
    assert g.accounted_s() == pytest.approx(g.wall_s)
    assert g.goodput == pytest.approx(90.0 / 150.0)
    assert g.started_at == datetime.fromtimestamp(100.0, UTC)


def test_time_after_the_last_step_with_a_stall_finding_in_it_is_a_hang():
    g = combine(
        "r", [(1, 0.0, 100.0)], {1: steps_row(1, last_step=40.0, productive=40.0, stalled_after=True)}
    )
    assert g.stall_s == 60.0 and g.accounted_s() == pytest.approx(100.0)


def test_an_attempt_that_never_stepped_is_all_startup():
    g = combine("r", [(1, 0.0, 20.0)], {})
    assert g.startup_s == 20.0 and g.productive_s == 0 and g.goodput == 0.0


def test_goodput_more_than_the_points_below_the_history_median_is_an_outlier():
    config = BaselineConfig(goodput_points=5)
    history = [90.0, 91.0, 89.5, 90.5, 90.2]
    assert compare_goodput(84.0, history, config).verdict == "OUTLIER"
    assert compare_goodput(86.0, history, config).verdict == "normal"  # 4.2 points below: within 5
    assert compare_goodput(99.0, history, config).verdict == "normal"  # better is never an outlier
    assert compare_goodput(None, history, config).verdict == "INVALID"
    assert compare_goodput(84.0, history[:3], config).verdict == "insufficient_history"
    assert compare_goodput(84.0, history, BaselineConfig(goodput_points=10)).verdict == "normal"


def _summary(run_id: str, day: int, goodput: float) -> RunSummary:
    return RunSummary(
        run_id=run_id,
        baseline_key="job",
        fingerprint="fp",
        status="completed",
        started_at=datetime(2026, 11, day, tzinfo=UTC),
        metrics={GOODPUT_METRIC: goodput},
    )


def test_the_gate_exits_1_on_a_goodput_drop_and_names_the_last_normal_run():
    history = [_summary(f"h{d}", d, 90.0 + (d % 3) * 0.5) for d in range(1, 7)]
    report = check_run(_summary("now", 20, 80.0), history, BaselineConfig())
    assert report.outliers == [GOODPUT_METRIC] and report.exit_code == EXIT_OUTLIER
    assert report.last_normal_run == "h6"
    assert check_run(_summary("ok", 20, 89.0), history, BaselineConfig()).exit_code == EXIT_NORMAL


T = datetime(2026, 12, 1, tzinfo=UTC)


def test_a_host_is_named_from_min_runs_distinct_runs_and_no_fewer():
    rows = [("j", f"r{i}", T, "straggler", "bad") for i in range(3)] + [("j", "r9", T, "straggler", "ok")]
    rows.append(("j", "r1", T, "straggler", "bad"))  # twice in one run: one run still
    assert count_lemons(rows, {"j": 5}, 3) == [LemonHost("bad", ["r0", "r1", "r2"], findings=4, crashes=0)]
    assert count_lemons(rows, {"j": 5}, 4) == []


def test_a_job_on_one_host_and_a_run_wide_finding_name_nothing():
    rows = [("j", f"r{i}", T, "straggler", "only") for i in range(5)]
    assert count_lemons(rows, {"j": 1}, 3) == []
    wide = [("j", f"r{i}", T, "stall", h) for i in range(5) for h in ("a", "b")]  # every host of each run
    assert count_lemons(wide, {"j": 2}, 3) == []


def test_crashes_count_even_when_several_hosts_crashed_in_one_run():
    rows = [("j", f"r{i}", T, "crash", "bad") for i in range(3)] + [("j", "r0", T, "crash", "other")]
    assert count_lemons(rows, {"j": 4}, 3) == [LemonHost("bad", ["r0", "r1", "r2"], findings=0, crashes=3)]


def test_the_demo_says_where_the_wall_time_went():
    from runwatch.demo.console import closing_lines

    seconds = {"productive": 3.2, "rollback_lost": 0.86, "stall": 14.0, "checkpoint": 0.03, "data_wait": 0.0}
    report = {
        "rollbacks": [],
        "steps": 160,
        "steps_completed": 160,
        "steps_executed": 170,
        "stopped": False,
        "report": None,
        "goodput": {"wall_s": 26.6, "goodput": 0.12, "seconds": seconds},
    }
    assert "goodput 12.0% of 26.6s wall time; lost: rollback lost 0.9s, stall 14.0s" in closing_lines(report)
