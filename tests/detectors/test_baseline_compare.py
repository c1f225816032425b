"""A run's summary against its job's history: the verdicts a CI gate and an alert rely on."""

from __future__ import annotations

import math
import random

import pytest
from pydantic import ValidationError

from runwatch.detectors.baselines.compare import (
    BaselineConfig,
    compare_metric,
    compare_run,
    metric_spec,
    outliers,
)

CONFIG = BaselineConfig()


def history(metric: str, center: float, rel_noise: float, n: int = 30, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{metric: center * (1 + rng.gauss(0, rel_noise))} for _ in range(n)]


def judge(metric: str, value, past: list[dict], config: BaselineConfig = CONFIG):
    (comparison,) = compare_run({metric: value}, past, config)
    return comparison


def test_a_commit_that_makes_steps_18_percent_slower_is_an_outlier_with_its_band():
    past = history("step_time_median_s", 0.200, 0.01)
    c = judge("step_time_median_s", 0.236, past)
    assert c.verdict == "OUTLIER" and c.n == 30
    assert c.low < 0.200 < c.high < 0.236
    assert c.change == pytest.approx(0.18, abs=0.01)
    assert "above the band" in c.reason


def test_better_is_never_a_regression():
    assert judge("step_time_median_s", 0.150, history("step_time_median_s", 0.2, 0.01)).verdict == "normal"
    assert judge("mfu", 0.60, history("mfu", 0.40, 0.01)).verdict == "normal"
    assert judge("mfu", 0.30, history("mfu", 0.40, 0.01)).verdict == "OUTLIER"  # lower MFU is worse
    assert (
        judge("max_cuda_peak_bytes", 4e9 + 30e9, history("max_cuda_peak_bytes", 30e9, 0.005)).verdict
        == "OUTLIER"
    )


def test_noise_inside_the_minimum_change_never_alarms_even_in_a_perfectly_steady_history():
    steady = [{"step_time_median_s": 0.2}] * 20  # MAD 0: the band is a point
    assert judge("step_time_median_s", 0.208, steady).verdict == "normal"  # +4%: under the 5% floor
    assert judge("step_time_median_s", 0.212, steady).verdict == "OUTLIER"  # +6%
    loose = BaselineConfig(min_change={"step_time_median_s": 0.10})
    assert judge("step_time_median_s", 0.212, steady, loose).verdict == "normal"


def test_a_noisy_history_widens_the_band_and_reports_its_spread():
    noisy = history("samples_per_s", 1000.0, 0.10, seed=3)
    c = judge("samples_per_s", 880.0, noisy)  # -12%: beyond the 5% floor but inside 3 robust sigmas
    assert c.verdict == "normal"
    assert c.spread == pytest.approx(0.10, rel=0.35)
    assert judge("samples_per_s", 500.0, noisy).verdict == "OUTLIER"


@pytest.mark.parametrize(
    "value, reason",
    [
        (None, "missing"),
        (math.nan, "not finite"),
        (math.inf, "not finite"),
        (-1.0, "sentinel"),
        (0.0, "sentinel"),
    ],
)
def test_missing_non_finite_and_sentinel_values_are_invalid_never_normal(value, reason):
    c = judge("mfu", value, history("mfu", 0.4, 0.01))
    assert c.verdict == "INVALID" and reason in c.reason


def test_too_little_history_says_so_and_invalid_history_does_not_count():
    past = history("step_time_median_s", 0.2, 0.01, n=4) + [
        {"step_time_median_s": None},
        {"step_time_median_s": math.nan},
        {},
    ]
    c = judge("step_time_median_s", 0.5, past)
    assert c.verdict == "insufficient_history" and c.n == 4 and "5 needed" in c.reason


def test_a_loss_may_be_negative_but_a_memory_figure_may_not():
    assert judge("final_loss", -0.5, history("final_loss", -0.5, 0.01)).verdict == "normal"
    assert judge("max_host_rss_bytes", -1, history("max_host_rss_bytes", 1e9, 0.01)).verdict == "INVALID"


def test_families_are_judged_by_prefix_and_unknown_metrics_are_left_out():
    assert metric_spec("loss_at_step_300") is not None and metric_spec("category_loss_speech") is not None
    assert metric_spec("anomalies_loss_spike") is not None and metric_spec("git_sha") is None
    past = [{"loss_at_step_300": 1.0 + 0.01 * i, "run_id": None} for i in range(10)]
    comparisons = compare_run({"loss_at_step_300": 1.5, "run_id": None, "world_size": 8}, past, CONFIG)
    assert [c.metric for c in comparisons] == ["loss_at_step_300"]
    assert [c.metric for c in outliers(comparisons)] == ["loss_at_step_300"]


def test_a_count_that_was_always_zero_flags_any_rise():
    past = [{"rollbacks": 0}] * 10
    assert judge("rollbacks", 0, past).verdict == "normal"
    assert judge("rollbacks", 1, past).verdict == "OUTLIER"


def test_the_config_refuses_nonsense():
    with pytest.raises(ValidationError):
        BaselineConfig(min_runs=1)
    with pytest.raises(ValidationError):
        BaselineConfig(window_days=0)
    with pytest.raises(ValidationError):
        BaselineConfig(unknown=1)


def test_compare_metric_takes_any_iterable_history():
    spec = metric_spec("tokens_per_s")
    assert spec is not None
    c = compare_metric("tokens_per_s", 100.0, iter([100.0] * 6), spec, CONFIG)
    assert c.verdict == "normal" and c.median == 100.0 and c.change == 0.0
