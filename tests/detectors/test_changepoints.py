"""E-divisive change points over a metric's history, and the first run / commit of a new level."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from runwatch.detectors.baselines.changepoints import (
    _best_split,
    baseline_segments,
    first_level_change,
    scan,
    scan_history,
)
from runwatch.detectors.baselines.summary import RunSummary

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def brute_qhat(z: np.ndarray) -> tuple[int, float]:
    """qhat by its definition (Matteson & James; Otava's QQ), every split and end."""
    best = (0, -np.inf)
    for tau in range(1, len(z)):
        for kappa in range(tau + 1, len(z) + 1):
            x, y = z[:tau], z[tau:kappa]
            n, m = len(x), len(y)
            between = np.abs(x[:, None] - y[None, :]).sum()
            wx = np.abs(x[:, None] - x[None, :]).sum() / 2
            wy = np.abs(y[:, None] - y[None, :]).sum() / 2
            q = 2 / (m + n) * between
            q -= 2 * m / ((m + n) * (n - 1)) * wx if n > 1 else 0
            q -= 2 * n / ((m + n) * (m - 1)) * wy if m > 1 else 0
            if q > best[1]:
                best = (tau, q)
    return best


def test_qhat_is_the_energy_statistic_by_its_definition():
    rng = np.random.default_rng(5)
    for n in (2, 3, 7, 20):
        z = rng.normal(size=n)
        tau, q = _best_split(z, 1.0)
        want_tau, want_q = brute_qhat(z)
        assert tau == want_tau and q == pytest.approx(want_q)


def test_a_step_in_a_noisy_series_is_found_at_the_right_index():
    rng = np.random.default_rng(0)
    values = np.r_[0.200 * (1 + rng.normal(0, 0.02, 25)), 0.240 * (1 + rng.normal(0, 0.02, 15))]
    (cp,) = scan(values, seed=1)
    assert cp.index == 25
    assert cp.relative_change == pytest.approx(0.20, abs=0.03)
    assert cp.mean_before == pytest.approx(0.200, rel=0.02) and cp.mean_after == pytest.approx(
        0.240, rel=0.02
    )
    assert cp.pvalue <= 0.01


def test_two_steps_are_both_found():
    rng = np.random.default_rng(2)
    values = np.r_[rng.normal(1.0, 0.02, 15), rng.normal(1.2, 0.02, 15), rng.normal(1.1, 0.02, 15)]
    # the minimum magnitude drops what the permutation test alone lets through in a short segment
    # (a 3-run piece of the middle level), as Otava's merge step does
    assert [cp.index for cp in scan(values, seed=0, min_magnitude=0.04)] == [15, 30]


@pytest.mark.parametrize("seed", range(5))
def test_pure_noise_has_no_change_point(seed):
    values = np.random.default_rng(100 + seed).normal(0.2, 0.004, 40)
    assert scan(values, seed=seed) == []


def test_the_same_seed_gives_the_same_answer_and_a_constant_series_has_no_change():
    rng = np.random.default_rng(3)
    values = np.r_[rng.normal(1.0, 0.05, 12), rng.normal(1.1, 0.05, 12)]
    assert scan(values, seed=7) == scan(values, seed=7)
    assert scan([3.0] * 20) == [] and scan([1.0, 2.0]) == []


def test_a_change_below_the_minimum_magnitude_is_dropped():
    values = np.r_[np.full(15, 1.0), np.full(15, 1.02)] + np.random.default_rng(4).normal(0, 0.001, 30)
    assert [cp.index for cp in scan(values)] == [15]
    assert scan(values, min_magnitude=0.05) == []


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="finite"):
        scan([1.0, float("nan"), 2.0])
    with pytest.raises(ValueError, match="power"):
        scan([1.0, 2.0, 3.0], power=2.0)


def summary(
    i: int,
    step_time: float,
    mfu: float,
    *,
    fingerprint: str = "fp-a",
    new_baseline: bool = False,
    status: str = "completed",
) -> RunSummary:
    return RunSummary(
        run_id=f"run-{i:02d}",
        baseline_key="job",
        git_sha=f"sha{i:02d}",
        fingerprint=fingerprint,
        started_at=T0 + timedelta(days=i),
        status=status,
        new_baseline=new_baseline,
        metrics={"step_time_median_s": step_time, "mfu": mfu, "unjudged": 1.0},
    )


def test_the_history_scan_names_the_first_regressed_run_and_its_commit_by_direction():
    rng = np.random.default_rng(9)
    runs = [
        summary(
            i,
            0.2 * (1.2 if i >= 12 else 1.0) * (1 + rng.normal(0, 0.01)),
            0.4 * (1.1 if i >= 20 else 1.0) * (1 + rng.normal(0, 0.01)),
        )
        for i in range(30)
    ]
    changes = scan_history(runs)
    step = first_level_change(changes, "step_time_median_s")
    assert step is not None and (step.run_id, step.git_sha, step.previous_sha) == ("run-12", "sha12", "sha11")
    assert step.kind == "regression" and step.relative_change == pytest.approx(0.2, abs=0.03)
    mfu = first_level_change(changes, "mfu", kind=None)
    assert mfu is not None and (mfu.run_id, mfu.kind) == ("run-20", "improvement")  # higher MFU is better
    assert first_level_change(changes, "mfu") is None
    assert {c.metric for c in changes} == {"step_time_median_s", "mfu"}


def test_other_hardware_and_a_declared_new_baseline_are_separate_histories_not_changes():
    rng = np.random.default_rng(11)
    runs = [summary(i, 0.2 * (1 + rng.normal(0, 0.01)), 0.4) for i in range(12)]
    runs += [summary(i, 0.3 * (1 + rng.normal(0, 0.01)), 0.4, fingerprint="fp-b") for i in range(12, 24)]
    runs += [summary(i, 0.25 * (1 + rng.normal(0, 0.01)), 0.4, new_baseline=(i == 24)) for i in range(24, 36)]
    runs.append(summary(40, 9.9, 0.4, status="failed"))
    segments = baseline_segments(runs)
    assert [len(s) for s in segments] == [12, 12, 12]
    assert scan_history(runs) == []
