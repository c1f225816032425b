"""The detector suite on the full generated corpus (real training runs), with default config,
and the same evaluation with naive fixed thresholds, to show the adaptivity earns its keep."""

from __future__ import annotations

import math

import pytest

from runwatch.contract.schema import EvalEvent, HeartbeatEvent, StepEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine import detector_views, monitor
from runwatch.detectors.findings import Finding
from runwatch.detectors.offline.evaluate import Corpus, corpus_bands, evaluate_corpus
from runwatch.detectors.offline.replay import replay
from runwatch.producer.instrument.gradstats import ROOT_MODULE
from runwatch.scenarios.corpus import generate

pytestmark = pytest.mark.integration

# None: the one fault no per-run detector can see (the randn mel-scale mistake, there from step 0, its
# owner never the largest or a changing module in a tiny model: tests/producer/test_bad_init.py) is found by
# baseline_trajectory against its job's history, the earlier runs of its correctly initialised twin.
NOT_DETECTABLE_WITHIN_ONE_RUN: set[str] = set()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    out = tmp_path_factory.mktemp("corpus")
    generate(out)  # the full catalog, as `runwatch scenarios generate` writes it (about a minute)
    return Corpus(out)


@pytest.fixture(scope="module")
def default_evaluation(corpus):
    return evaluate_corpus(corpus)


def test_every_detectable_fault_is_found_by_the_right_detector_with_no_false_alarms(default_evaluation):
    results = {s.name: s for s in default_evaluation.scenarios}
    faults = [s for s in results.values() if s.fault != "healthy"]
    assert len(faults) >= 12 and len(results) - len(faults) >= 10
    missed = {s.name for s in faults if not s.correct_detector}
    assert missed == NOT_DETECTABLE_WITHIN_ONE_RUN
    assert all(s.false_alarms == 0 for s in results.values()), [
        s.first_false_alarm for s in results.values() if s.false_alarms
    ]
    assert default_evaluation.summary["false_alarms_per_10k_healthy_steps"] == 0


def test_the_bad_init_is_found_against_the_twins_history_naming_the_owner(corpus):
    """bad_init_audio against the band of its twins (same baseline key, started before it): the finding
    names the owner of the randn scale, far above where that module sat in the earlier runs; the
    twin compared with the same kind of history raises nothing (the evaluation's 0 false alarms)."""
    config = RunwatchConfig()
    bands = corpus_bands(corpus, config)
    events = corpus.events["bad_init_audio"]
    band = bands[events[0].run_id]
    assert not isinstance(band, str) and band.n_runs == 4 and band.baseline_key == "scenarios/audio"
    twin = bands[corpus.events["healthy_audio_fixed_init"][0].run_id]
    assert not isinstance(twin, str) and twin.n_runs == 3
    found = [a for a in replay(events, config, bands=bands).anomalies if a.detector == "baseline_trajectory"]
    first = found[0]
    assert first.evidence["module"] == ROOT_MODULE and first.step < 20 and first.severity != "info"
    assert first.value > 10 * first.evidence["band_hi"]
    # every other run's band is empty of history or its own job's: nothing but info elsewhere
    assert all(
        isinstance(b, str)
        for name, b in ((n, bands[e[0].run_id]) for n, e in corpus.events.items())
        if "audio" not in name
    )


def test_delays_meet_the_targets(default_evaluation, corpus):
    results = {s.name: s for s in default_evaluation.scenarios}
    labels = {label.name: label for label in corpus.labels}
    for s in results.values():
        if s.fault == "non_finite":
            assert s.delay_steps == 0, s
        if s.fault in ("loss_spike", "grad_norm_spike"):
            assert s.delay_steps <= 1, s
    assert results["throughput_halved_cnn"].delay_steps <= 30
    # issue 37's shapes: each named within 60 steps of its onset
    for name in (
        "frozen_modules_mlp",
        "weight_decay_x100_mlp",
        "eval_category_shuffled_labels_mlp",
        "val_leak_mlp",
        "optimizer_swap_mlp",
        "category_near_chance_cnn",  # the spread test (sumsq, tail_count): 51 steps
        "activation_growth_mlp",
    ):
        assert results[name].correct_detector and results[name].delay_steps <= 60, results[name]
    # dead units: found at the first activation sample after the onset (activations_every = 5)
    assert results["dead_units_mlp"].correct_detector and results["dead_units_mlp"].delay_steps <= 5
    for name in ("stall_hang_train", "stall_dataload_hang"):
        steps = [e for e in corpus.events[name] if isinstance(e, StepEvent)]
        intervals = sorted(
            (b.ts - a.ts).total_seconds()
            for a, b in zip(steps, steps[1:], strict=False)
            if b.step == a.step + 1
        )
        median = intervals[len(intervals) // 2]
        allowance = {"train": 10.0, "dataload": 60.0}[labels[name].phase]
        # within 3 median step intervals plus the phase allowance, plus one tick of the timer (0.25 s)
        assert results[name].delay_s <= 3 * median + allowance + 0.25, (name, results[name].delay_s)


# -- naive fixed thresholds: what a hand-written check would use, the same for every run ----------
# loss > 3; grad norm > 10 (clip at 1, alarm at 10); any module's grad norm > 5; relative update
# outside 1e-4..1e-2; step time > 1 s; data wait > 30% of the step; host RSS or CUDA allocated above
# 90% of the limit; a category's loss > 2x the mean loss; val loss above the previous eval; no step
# for 60 s. Each fires when its condition becomes true (edge-triggered), naming the module or
# category where it has one. Non-finite values are caught exactly either way.
class FixedRule(Detector):
    def __init__(self, name, check):
        self.name = name
        self._check = check
        self._active: set = set()

    def update(self, event, now):
        found = []
        hits = self._check(self, event) or []
        for key, message, evidence in hits:
            if key not in self._active:
                found.append(
                    Finding(
                        detector=self.name,
                        metric=self.name,
                        step=getattr(event, "step", None),
                        rank=event.rank,
                        severity="warning",
                        message=message,
                        evidence=evidence,
                    )
                )
        self._active = {key for key, _, _ in hits}
        return found


def _finite(value):
    return value is not None and math.isfinite(value)


def _step_rule(name, predicate):
    def check(_rule, event):
        if isinstance(event, StepEvent):
            return predicate(event) or []
        return []

    return lambda config, progress: FixedRule(name, check)


def _memory_hits(e):
    m = e.memory
    if m is None:
        return []
    hits = []
    if m.allocated and m.device_total and m.allocated > 0.9 * m.device_total:
        hits.append(("alloc", "allocated above 90% of the device", {"kind": "leak"}))
    if m.host_rss and m.cgroup_limit and m.host_rss > 0.9 * m.cgroup_limit:
        hits.append(("rss", "RSS above 90% of the limit", {"kind": "leak"}))
    return hits


def _val_rule(config, progress):
    def check(rule, event):
        if isinstance(event, EvalEvent) and _finite(event.loss):
            previous, rule.previous = getattr(rule, "previous", None), event.loss
            if previous is not None and event.loss > previous:
                return [(event.step, "val loss went up", {})]
        return []

    return FixedRule("val_vs_train", check)


def _stall_rule(config, progress):
    def check(rule, event):
        if isinstance(event, StepEvent):
            rule.last_step_ts = event.ts
        elif isinstance(event, HeartbeatEvent) and getattr(rule, "last_step_ts", None) is not None:
            if (event.ts - rule.last_step_ts).total_seconds() > 60:
                return [("stall", "no step for 60 s", {"kind": "stalled", "phase": event.phase})]
        return []

    return FixedRule("stall", check)


NAIVE_DETECTORS = {
    "non_finite": monitor.DETECTORS["non_finite"],
    "loss_spike": _step_rule(
        "loss_spike", lambda e: [("x", "loss > 3", {})] if _finite(e.loss) and e.loss > 3 else []
    ),
    "grad_norm_spike": _step_rule(
        "grad_norm_spike",
        lambda e: [("x", "grad norm > 10", {})] if _finite(e.grad_norm) and e.grad_norm > 10 else [],
    ),
    "module_grad_explosion": _step_rule(
        "module_grad_explosion",
        lambda e: [
            (m, f"{m} grad norm > 5", {"module": m})
            for m, v in e.module_grad_norms.items()
            if _finite(v) and v > 5
        ],
    ),
    "update_ratio": _step_rule(
        "update_ratio",
        lambda e: (
            []
            if not _finite(e.relative_update_norm)
            else (
                [("hi", "update ratio > 1e-2", {"kind": "too_large"})]
                if e.relative_update_norm > 1e-2
                else [("lo", "update ratio < 1e-4", {"kind": "vanishing"})]
                if e.relative_update_norm < 1e-4
                else []
            )
        ),
    ),
    "throughput_drift": _step_rule(
        "throughput_drift",
        lambda e: [("x", "step time > 1 s", {})] if _finite(e.step_time_s) and e.step_time_s > 1.0 else [],
    ),
    "data_wait": _step_rule(
        "data_wait",
        lambda e: (
            [("x", "data wait > 30%", {})]
            if _finite(e.data_wait_s)
            and _finite(e.step_time_s)
            and e.step_time_s > 0
            and e.data_wait_s / e.step_time_s > 0.3
            else []
        ),
    ),
    "memory_growth": _step_rule("memory_growth", _memory_hits),
    "category_divergence": _step_rule(
        "category_divergence",
        lambda e: [
            (c, f"{c} loss > 2x the mean", {"category": c})
            for c, v in e.category_loss.items()
            if _finite(e.loss) and e.loss > 0 and _finite(v.mean) and v.mean > 2 * e.loss
        ],
    ),
    "val_vs_train": _val_rule,
    "stall": _stall_rule,
}


def test_naive_fixed_thresholds_do_measurably_worse(corpus, default_evaluation, monkeypatch):
    # (the table is built in detector_views; the monitor keeps a name for it too)
    monkeypatch.setattr(detector_views, "DETECTORS", NAIVE_DETECTORS)
    monkeypatch.setattr(monitor, "DETECTORS", NAIVE_DETECTORS)
    naive = evaluate_corpus(corpus)
    ours, theirs = default_evaluation.summary, naive.summary
    print("adaptive:", ours)
    print("naive:   ", theirs)
    assert theirs["recall"] < ours["recall"] or (
        theirs["false_alarms_per_10k_healthy_steps"] > ours["false_alarms_per_10k_healthy_steps"]
    )
    # and concretely: naive thresholds both miss faults and cry wolf on this corpus (measured:
    # recall 0.77 against 0.95, and 1503 false alarms per 10k healthy steps against 0)
    assert theirs["recall"] < ours["recall"]
    assert theirs["false_alarms_per_10k_healthy_steps"] > 100
