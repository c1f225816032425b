"""The saturated-host corpus scenarios (scenarios/runwatch/scenarios/variants/throughput.py, issue 37): the
simulated host's onset arrivals, and the labels that pin both verdicts of ``throughput_drift`` there."""

from __future__ import annotations

import pytest

from runwatch.detectors.offline.evaluate import MATCHED_ATTRIBUTES
from runwatch.scenarios.catalog import CORPUS, SCENARIOS
from runwatch.scenarios.training import SaturatedHost
from runwatch.scenarios.variants.throughput import NOISY_NEIGHBOURS, SATURATED_HOST


def test_the_saturated_host_scenarios_labels_require_their_cause():
    """The run's own 2x slowdown on a saturated host is ``run``; the neighbours' slowdown the host explains
    only in part is ``unknown``; evaluate matches the label's ``cause`` against the finding's."""
    assert "cause" in MATCHED_ATTRIBUTES
    assert SCENARIOS["throughput_halved_saturated_host_cnn"].injector.label_fields()["cause"] == "run"
    neighbours = SCENARIOS["throughput_noisy_neighbours_cnn"]
    assert neighbours in CORPUS and neighbours.fault == "throughput_drift"
    assert neighbours.injector.label_fields() == {"magnitude": 1.0, "cause": "unknown"}
    assert "cause" not in SCENARIOS["throughput_halved_cnn"].injector.label_fields()  # no host load: any
    assert "cause" not in SCENARIOS["healthy_saturated_host_cnn"].injector.label_fields()


def test_a_scenario_host_without_arrivals_draws_as_before_and_ignores_the_onset():
    """The existing saturated-host recordings must not move: a host without ``others_after`` /
    ``slowdown_after`` gives the same shares and the same stretched compute, the onset or not."""
    plain, told = SaturatedHost(seed=41, **SATURATED_HOST), SaturatedHost(seed=41, **SATURATED_HOST)
    told.arrive(100.0)
    assert told.arrived_at is None
    for t in (0.0, 99.0, 100.0, 250.0):
        assert plain.share_at(t) == told.share_at(t)
        assert plain.stretch(0.3, t) == told.stretch(0.3, t)


def test_a_scenario_host_whose_jobs_arrive_at_the_onset_takes_cpu_and_slows_compute_no_cpu_figure_shows():
    before, after = SaturatedHost(seed=43, **SATURATED_HOST), SaturatedHost(seed=43, **NOISY_NEIGHBOURS)
    after.arrive(100.0)
    after.arrive(200.0)  # the first call counts (a rollback past the onset changes nothing)
    assert after.arrived_at == 100.0
    assert before.share_at(99.0) == after.share_at(99.0)  # nothing changes before they come
    lost = before.share_at(150.0) / after.share_at(150.0)
    assert lost == pytest.approx((after.others_at(150.0) + 1) / (before.others_at(150.0) + 1))
    assert lost > 1.4  # 4 more runnable tasks: its CPU share falls (its heartbeats' run-queue wait rises)
    # its compute: the smaller share, times the contention's 1.7 (the same jitter draw on both)
    assert after.stretch(0.3, 150.0) == pytest.approx(before.stretch(0.3, 150.0) * lost * 1.7)
