"""The per-step baseline band computed by ClickHouse (``BaselineReads.band``, on the embedded
engine) equals the pure one (``band_from_runs``) on real recorded training runs, and its baseline runs
are chosen from ``run_summaries`` by the same rule as ``select_baseline_runs``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from runwatch.detectors.baselines.band import band_from_runs, run_record, select_baseline_runs
from runwatch.detectors.baselines.summary import RunSummarizer
from runwatch.detectors.offline.evaluate import Corpus
from runwatch.scenarios.clocks import START
from runwatch.scenarios.corpus import generate
from runwatch.sinks.clickhouse import ClickHouseSink

pytestmark = pytest.mark.integration

AUDIO = [
    "healthy_audio_fixed_init_seed3",
    "healthy_audio_fixed_init_seed2",
    "healthy_audio_fixed_init_seed1",
    "healthy_audio_fixed_init",
    "bad_init_audio",
]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """The audio job's runs (real training, --quick), moved to ten days ago (telemetry has a 90-day
    TTL), stored with their summaries in a fresh embedded ClickHouse."""
    out = tmp_path_factory.mktemp("audio")
    generate(out, AUDIO, quick=True)
    corpus = Corpus(out)
    shift = datetime.now(UTC).replace(microsecond=0) - timedelta(days=10) - START
    runs = {
        name: [e.model_copy(update={"ts": e.ts + shift}) for e in events]
        for name, events in corpus.events.items()
    }
    sink = ClickHouseSink(f"chdb://{tmp_path_factory.mktemp('chdb')}")
    sink.migrate()
    summaries = []
    for events in runs.values():
        sink.writer.write_events(events)
        summarizer = RunSummarizer(events[0].run_id)
        for event in events:
            summarizer.observe(event)
        summaries.append(summarizer.summary())
    sink.writer.write_summaries(summaries)
    yield sink, runs
    sink.close()


def test_the_sql_band_equals_the_pure_band_on_real_runs(stored):
    sink, runs = stored
    records = {name: run_record(events) for name, events in runs.items()}
    by_id = {r.run_id: name for name, r in records.items()}
    for name in ("bad_init_audio", "healthy_audio_fixed_init"):
        me = records[name]
        history = select_baseline_runs(me, records.values(), window_days=30, max_runs=20)
        for bucket in (1, 7):
            band = sink.baselines.band(
                me.baseline_key,
                me.fingerprint,
                me.started_at,
                30,
                20,
                exclude_run=me.run_id,
                bucket_steps=bucket,
            )
            pure = band_from_runs(
                [runs[by_id[h.run_id]] for h in history],
                baseline_key=me.baseline_key,
                fingerprint=me.fingerprint,
                bucket_steps=bucket,
            )
            assert (
                band is not None
                and band.run_ids == pure.run_ids
                and band.n_runs == (4 if name == "bad_init_audio" else 3)
            )
            assert set(band.metrics) == set(pure.metrics) and "module_grad_norm/(root)" in band.metrics
            assert "eval_loss/val" in band.metrics and "memory_host_rss" in band.metrics
            for metric, expected in pure.metrics.items():
                got = band.metrics[metric]
                assert got.steps == expected.steps and got.runs == expected.runs, metric
                for column in ("lo", "mid", "hi"):
                    assert getattr(got, column) == pytest.approx(getattr(expected, column), rel=1e-9), (
                        metric,
                        column,
                    )


def test_the_band_runs_follow_the_history_rule(stored):
    sink, runs = stored
    records = {name: run_record(events) for name, events in runs.items()}
    me = records["bad_init_audio"]
    assert sink.baselines.band_runs(me.baseline_key, me.fingerprint, me.started_at, 30, 2, me.run_id) == [
        records["healthy_audio_fixed_init_seed1"].run_id,
        records["healthy_audio_fixed_init"].run_id,
    ]
    first = records["healthy_audio_fixed_init_seed3"]  # the job's first run has no history
    assert (
        sink.baselines.band(first.baseline_key, first.fingerprint, first.started_at, exclude_run=first.run_id)
        is None
    )
    # the window: runs started more than 2.5 days before are out
    assert (
        len(sink.baselines.band_runs(me.baseline_key, me.fingerprint, me.started_at, 2.5, 20, me.run_id)) == 2
    )
    assert (
        sink.baselines.band_runs(me.baseline_key, "another-fingerprint", me.started_at, 30, 20, me.run_id)
        == []
    )


def test_a_declared_new_baseline_restarts_the_history(stored):
    sink, runs = stored
    records = {name: run_record(events) for name, events in runs.items()}
    me = records["bad_init_audio"]
    declaring = sink.baselines.summary(records["healthy_audio_fixed_init_seed2"].run_id)
    sink.writer.write_summaries([declaring.model_copy(update={"new_baseline": True})])
    try:
        assert sink.baselines.band_runs(
            me.baseline_key, me.fingerprint, me.started_at, 30, 20, me.run_id
        ) == [
            records[name].run_id
            for name in (
                "healthy_audio_fixed_init_seed2",
                "healthy_audio_fixed_init_seed1",
                "healthy_audio_fixed_init",
            )
        ]
    finally:
        sink.writer.write_summaries([declaring])


def test_the_worker_loads_the_band_at_run_start_and_the_bad_init_is_named(stored):
    """The worker's processor with a ``BaselineLoader`` loader on the stored history: the bad-init run,
    fed as raw telemetry, gets a baseline_trajectory anomaly naming the owner; a run of an unknown
    job says once why it is not compared."""
    from runwatch.detectors.config import RunwatchConfig
    from runwatch.worker.baselines import BaselineLoader
    from runwatch.worker.processor import TelemetryProcessor
    from tests.support.action_keys import SEED

    sink, runs = stored
    config = RunwatchConfig()
    # (this process already holds the chdb path; a worker opens its own DSN)
    bands = BaselineLoader(sink.dsn, config, timeout_s=30.0, sink=sink)
    processor = TelemetryProcessor(config, SEED, baselines=bands)

    def anomalies(event):  # as the worker reads it: keyed by run id, sent at its ts
        return processor.process(
            event.to_json(), event.run_id.encode(), timestamp=event.ts.timestamp()
        ).anomalies

    try:
        found = [
            a for e in runs["bad_init_audio"] for a in anomalies(e) if a.detector == "baseline_trajectory"
        ]
        assert found[0].evidence["module"] == "(root)" and found[0].evidence["baseline_runs"] == 4
        other = [e.model_copy(update={"run_id": "unknown-job"}) for e in runs["bad_init_audio"]]
        other[0] = other[0].model_copy(update={"baseline_key": "nobody/else"})
        said = [a for e in other for a in anomalies(e) if a.detector == "baseline_trajectory"]
        assert [a.severity for a in said] == ["info"] and "no earlier completed run" in said[0].message
    finally:
        bands.close()
