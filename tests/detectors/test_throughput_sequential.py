"""The throughput detector's sequential test (issue 27): a CUSUM of robust z's raises the question at once, a
creep is found once it has crept by ``min_change`` (not once its average has), the onset is where the rise
began, and the level "now" spans ``min_duration_s`` and is measured precisely enough. And contention named,
not blamed: a slowdown the host explains is named as contention, an ``info`` finding (no alarm) on a host
saturated before and after, while a slowdown of the run's own on the same host is still a warning."""

from __future__ import annotations

import math
import pickle
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from runwatch.contract.schema import HeartbeatEvent, HostLoad, RunEndEvent, StepEvent, TelemetryEvent
from runwatch.detectors.findings import Finding
from runwatch.detectors.throughput import (
    MAX_LEVEL_SE,
    MEDIAN_SE,
    ThroughputConfig,
    ThroughputDetector,
    onset_of_rise,
)

T0 = datetime(2026, 5, 1, tzinfo=UTC)
HEARTBEAT_EVERY = 5  # steps


def stream(
    seed: int,
    n: int,
    step_s: Callable[[int], float],
    *,
    sigma: float = 0.05,
    host: Callable[[int], dict[str, Any]] | None = None,
) -> list[TelemetryEvent]:
    """Steps of ``step_s(i)`` seconds with log-normal noise, each event at the end of its step; with
    ``host``, a heartbeat every HEARTBEAT_EVERY steps carrying ``host(i)`` as its host load; a run end."""
    rng = np.random.default_rng(seed)
    now, events = T0, []
    for i in range(n):
        t = step_s(i) * math.exp(rng.normal(0, sigma))
        now += timedelta(seconds=t)
        events.append(StepEvent(run_id="r", step=i, ts=now, step_time_s=t))
        if host is not None and i % HEARTBEAT_EVERY == HEARTBEAT_EVERY - 1:
            figures = {k: round(v * math.exp(rng.normal(0, 0.02)), 4) for k, v in host(i).items()}
            events.append(
                HeartbeatEvent(
                    run_id="r", step=i, ts=now, interval_s=5.0, host_load=HostLoad(cpus=2, **figures)
                )
            )
    events.append(RunEndEvent(run_id="r", ts=now + timedelta(seconds=1)))
    return events


def run(events: list[TelemetryEvent], config: ThroughputConfig | None = None) -> list[Finding]:
    detector = ThroughputDetector(config or ThroughputConfig())
    return [f for e in events for f in detector.update(e, e.ts)]


def creep(onset: int, to: float, over: int, base: float = 0.4) -> Callable[[int], float]:
    """``base`` seconds, from ``onset`` growing linearly to ``to`` times that over ``over`` steps."""
    return lambda i: base * (1 + (to - 1) * min(1.0, max(0, i - onset + 1) / over))


# -- the sequential test ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_a_creep_is_found_once_it_has_crept_by_min_change(seed):
    """+80% over 180 steps (the corpus's throughput_creep_transformer): the median since the onset reaches
    +30% only about 125 steps in; the level now does about 70 steps in."""
    finding = run(stream(seed, 480, creep(300, 1.8, 180)))[0]  # (crept another 30% later: found again)
    assert 300 + 45 <= finding.step <= 300 + 80, finding.message
    assert 295 <= finding.evidence["onset_step"] <= 300 + 25  # where it began, not its middle
    assert 0.3 <= finding.evidence["change"] <= 0.45
    assert finding.evidence["after_s"] == pytest.approx(0.4 * 1.35, rel=0.1)


@pytest.mark.parametrize("seed", range(3))
def test_a_slower_creep_is_found_too(seed):
    """+60% over 300 steps (0.2% a step): found once it is 30% slower, about 150 steps in."""
    finding = run(stream(seed, 600, creep(300, 1.6, 300, base=0.3)))[0]
    assert 300 + 120 <= finding.step <= 300 + 185, finding.message
    assert finding.evidence["change"] >= 0.3


def test_a_jump_shortly_after_one_slow_step_is_timed_from_the_jump():
    """A checkpoint step (5x) keeps the CUSUM above zero for a few steps; the jump 8 steps later is the
    onset, not that step."""
    events = stream(0, 700, lambda i: 0.25 * (5 if i == 492 else 2 if i >= 500 else 1), sigma=0.1)
    (finding,) = run(events)
    assert finding.evidence["onset_step"] == 500 and 500 < finding.step <= 510


def test_onset_of_rise_tells_a_ramp_from_a_jump():
    z = np.zeros(100)
    ramp, jump = z.copy(), z.copy()
    ramp[60:] = np.arange(1, 41) * 0.1  # a straight rise from index 60
    jump[50] = 4.0  # one slow step
    jump[58:] = 4.0  # then a jump
    assert onset_of_rise(ramp, 58) == 58  # the rise began where the CUSUM left zero (two steps early)
    assert onset_of_rise(jump, 50) == 58


def test_the_level_now_spans_min_duration_for_short_steps():
    """20 ms steps made 1.5x slower: the recent median spans 2 s (about 70 steps of 30 ms), not 10 steps."""
    events = stream(1, 1500, lambda i: 0.02 * (1.5 if i >= 800 else 1.0), sigma=0.3)
    (finding,) = run(events)
    first = finding.evidence["recent_from_step"]
    steps = {e.step: e for e in events if isinstance(e, StepEvent)}
    assert (steps[finding.step].ts - steps[first - 1].ts).total_seconds() >= 2.0
    assert finding.evidence["steps_recent"] >= 60


def test_noisy_steps_wait_until_the_new_level_is_measured_precisely():
    (finding,) = run(stream(2, 1200, lambda i: 0.25 * (2 if i >= 700 else 1), sigma=0.25))
    scale = finding.evidence["robust_scale_log"]
    assert MEDIAN_SE * scale / math.sqrt(finding.evidence["steps_recent"]) <= MAX_LEVEL_SE
    assert finding.evidence["after_s"] == pytest.approx(0.5, rel=0.15)


def test_a_higher_cusum_threshold_asks_later():
    events = stream(3, 700, lambda i: 0.4 * (1.35 if i >= 400 else 1), sigma=0.15)
    (default,) = run(events)
    (strict,) = run(events, ThroughputConfig(cusum_threshold=40))
    assert default.step < strict.step


def test_a_detector_pickled_before_the_cusum_resumes():
    events = stream(4, 900, lambda i: 0.25 * (2 if i >= 600 else 1))
    detector = ThroughputDetector(ThroughputConfig())
    for e in events[:500]:
        detector.update(e, e.ts)
    state = pickle.dumps(detector)
    old = pickle.loads(state)
    for name in ("_cusum", "_rise_at"):  # attributes a detector of the ADWIN days did not have
        del old.__dict__[name]
    found = [f for e in events[500:] for f in old.update(e, e.ts)]
    assert len(found) == 1 and abs(found[0].evidence["onset_step"] - 600) <= 2


# -- contention named, not blamed ------------------------------------------------------------------

SATURATED = {"load1": 6.5, "steal_frac": 0.0, "process_cpu_frac": 0.35, "cpu_wait_frac": 0.65}
MORE_JOBS = {"load1": 8.5, "steal_frac": 0.0, "process_cpu_frac": 0.25, "cpu_wait_frac": 0.75}
CALM = {"load1": 0.8, "steal_frac": 0.0, "process_cpu_frac": 0.95, "cpu_wait_frac": 0.02}


def on_host(before: dict[str, float], after: dict[str, float], at: int) -> Callable[[int], dict[str, float]]:
    return lambda i: after if i >= at else before


def test_contention_on_a_host_saturated_throughout_is_info_with_its_evidence():
    """More jobs on a host already 3x oversubscribed: the run gets 25% of a CPU instead of 35% and its
    steps take 1.4x as long. Named as contention, not raised as the run's regression."""
    events = stream(
        5, 700, lambda i: 1.0 * (1.4 if i >= 400 else 1), sigma=0.15, host=on_host(SATURATED, MORE_JOBS, 400)
    )
    (finding,) = run(events)
    assert finding.severity == "info" and finding.evidence["cause"] == "contention"
    verdict = finding.evidence["contention"]
    assert verdict["saturated_before"] and verdict["saturated_now"]
    assert verdict["explained"] == pytest.approx(0.35 / 0.25, rel=0.1) and "cpu_wait" in verdict["factors"]
    assert finding.message.startswith(
        "contention on a host saturated throughout, not the run's own slowdown: "
    )
    saturated = r"; host [^;]*saturated throughout \(6\.\d → 8\.\d on 2 CPUs, 3\.\d → 4\.\d per CPU\)"
    assert re.search(saturated, finding.message), finding.message
    assert "this process's CPU share 35% → 25%, the rest waiting for a CPU" in finding.message


def test_a_slowdown_of_the_run_own_on_a_saturated_host_is_still_a_warning():
    """Same host, same load, the run's CPU share unchanged: its steps do twice the work."""
    events = stream(6, 700, lambda i: 1.0 * (2 if i >= 400 else 1), sigma=0.15, host=lambda i: SATURATED)
    (finding,) = run(events)
    assert finding.severity == "warning" and finding.evidence["cause"] == "run"
    assert 400 <= finding.evidence["onset_step"] <= 403
    assert "host load unchanged, saturated throughout" in finding.message


def test_after_contention_a_regression_of_the_run_is_still_found():
    """Contention (info) at step 300 does not mute the detector for its cooldown: the run's own 2x at
    step 380 is found."""
    load = on_host(SATURATED, MORE_JOBS, 300)
    events = stream(
        7, 700, lambda i: 1.0 * (1.4 if i >= 300 else 1) * (2 if i >= 380 else 1), sigma=0.15, host=load
    )
    found = run(events)
    assert [f.severity for f in found] == ["info", "warning"], [f.message for f in found]
    assert found[1].evidence["cause"] == "run" and 380 <= found[1].evidence["onset_step"] <= 383
    assert found[1].step <= 380 + 40


def test_a_neighbour_arriving_is_contention_and_still_an_alert():
    """The host was calm; CPU hogs arrive and the run gets 45% of a CPU: its slowdown is contention, but
    the host was not saturated before, so the finding stays a warning that names it."""
    hogs = {"load1": 3.5, "steal_frac": 0.0, "process_cpu_frac": 0.45, "cpu_wait_frac": 0.55}
    events = stream(8, 700, lambda i: 0.5 * (2 if i >= 400 else 1), sigma=0.1, host=on_host(CALM, hogs, 400))
    (finding,) = run(events)
    assert finding.severity == "warning" and finding.evidence["cause"] == "contention"
    assert finding.message.startswith("contention: step time rose")
    assert "host busier at the same step" in finding.message


def test_without_host_load_a_finding_names_no_cause():
    (finding,) = run(stream(9, 700, lambda i: 0.25 * (2 if i >= 400 else 1)))
    assert finding.severity == "warning" and "cause" not in finding.evidence


def test_a_config_that_still_sets_the_adwin_delta_loads_with_a_warning(caplog):
    from runwatch.detectors.config import RunwatchConfig

    with caplog.at_level("WARNING"):
        config = RunwatchConfig.model_validate({"detectors": {"throughput_drift": {"delta": 0.01}}})
    assert config.detectors.throughput_drift.cusum_threshold == 12.0
    assert "throughput_drift.delta no longer does anything" in caplog.text


def test_a_jump_after_steps_kept_a_little_slow_by_a_busy_host_is_dated_at_the_jump():
    """A busy host had kept the steps a little slow (z about 1) and the CUSUM above zero for 150 steps when
    the run itself got 3x slower (z at its clip): the onset is the jump, not where the CUSUM left zero (a
    CI run dated a sleep that began at step 365 'since about step 204')."""
    rng = np.random.default_rng(0)
    z = np.concatenate([rng.normal(0, 0.3, 50), 1.0 + rng.normal(0, 0.5, 150), np.full(28, 4.0)])
    assert abs(onset_of_rise(z, 50) - 200) <= 2
    creep = np.concatenate([np.zeros(50), np.linspace(0, 4, 150) + rng.normal(0, 0.3, 150)])
    assert onset_of_rise(creep, 50) == 50  # a creep is still dated from where it began
