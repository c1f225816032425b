"""Every Grafana panel's SQL, every variable's and every annotation's, with the macros expanded as the
ClickHouse plugin expands them, runs against the embedded ClickHouse holding real pipeline data and
returns the columns its panel expects, with rows:

- a `nan` demo run (the session's broker, a real worker, the sink): anomalies, actions, a rollback;
- a 3-rank torch.distributed run (dist_train.py) with a straggler (its fake NVML reporting a thermal
  throttle) and a hung rank that the worker stops,
  on a broker of its own (its worker runs a test config in its own group and must not re-read
  the session's topics), with a garbage message the worker dead-letters;
- a job's history: the history corpus (47 real training runs at the commits of a real git repository,
  over six simulated weeks) moved to the last seven weeks (telemetry has a 90-day TTL), with their run
  summaries.

The Baselines dashboard's band and outlier table are also checked against the Python they mirror
(``BaselineReads.band``, ``check_run``)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from kafka import KafkaProducer

from runwatch.contract import topics
from runwatch.contract.action_kinds import ACTION_KINDS
from runwatch.detectors.baselines.check import check_run
from runwatch.detectors.baselines.compare import BaselineConfig
from runwatch.detectors.baselines.summary import RunSummarizer
from runwatch.detectors.offline.replay import read_events
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.scenarios.history import generate as generate_history
from runwatch.sinks import ClickHouseSink, SinkConsumer
from runwatch.sinks.grafana.dashboards import DATABASE
from runwatch.sinks.grafana.macros import QueryContext, expand, interval_for
from runwatch.sinks.grafana.panels import (
    BASELINE_BAND,
    BASELINE_OUTLIERS,
    BASELINES_DASHBOARD,
    DASHBOARDS,
    FLEET,
    METRIC_VAR,
    PIPELINE,
    RANKS_DASHBOARD,
    RUN_DASHBOARD,
)
from tests.conftest import eventually, worker_with_config
from tests.worker.test_multi_rank import CONFIG as DIST_CONFIG
from tests.worker.test_multi_rank import STOP_EXIT_CODE, WORLD, Run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dist_run(chdb_dsn, action_keys, tmp_path_factory) -> str:
    """A 3-rank run (rank 2 a straggler, rank 1 hung at step 30 until the escalated stop) stored in
    ``chdb_dsn`` by a sink on a broker of its own; its run id."""
    folder = tmp_path_factory.mktemp("grafana-dist")
    broker = EmbeddedBroker(log_path=folder / "broker.log").start()
    sink = ClickHouseSink(chdb_dsn)
    sink.migrate()
    try:
        ensure_topics(broker.bootstrap)
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=topics.KAFKA_API_VERSION)
        producer.send(topics.TELEMETRY, key=b"grafana-garbage", value=b"{not json").get(timeout=30)
        producer.close()
        consumer = SinkConsumer(sink, broker.bootstrap, batch_interval_s=0.25)
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        try:
            with worker_with_config(broker, action_keys, folder, DIST_CONFIG, "runwatch-detect-grafana"):
                (folder / "run").mkdir()
                run = Run(
                    broker,
                    action_keys.public_text,
                    folder / "run",
                    "slow:2:0.2",
                    "hang:1:30",
                    steps=400,
                    stop_exit_after_s=2.0,
                    env={"RUNWATCH_TEST_FAKE_NVML": "2"},  # rank 2's (fake) GPU throttled: dist_train.py
                )
                try:
                    codes = run.wait(150)
                    assert codes == [STOP_EXIT_CODE] * WORLD, run.logs()
                finally:
                    run.kill()

                def stored() -> bool:
                    found = {
                        d
                        for (d,) in sink.query(
                            "SELECT DISTINCT detector FROM {db}.anomalies FINAL WHERE run_id = %(r)s",
                            {"r": run.run_id},
                        )
                    }
                    kinds = {
                        k
                        for (k,) in sink.query(
                            "SELECT DISTINCT kind FROM {db}.actions FINAL WHERE run_id = %(r)s",
                            {"r": run.run_id},
                        )
                    }
                    return {"straggler", "hung_rank"} <= found and "stop" in kinds

                eventually(
                    stored, 60, "the straggler, the hung rank and the stop in ClickHouse", interval=0.5
                )
                eventually(
                    lambda: sink.query("SELECT count() FROM {db}.deadletter FINAL")[0][0] > 0,
                    30,
                    "the dead letter in ClickHouse",
                    interval=0.5,
                )
                time.sleep(1.0)  # the last heartbeats and joined steps of the stopped ranks
        finally:
            consumer.stopping.set()
            thread.join(30)
        return run.run_id
    finally:
        sink.close()
        broker.stop()


@pytest.fixture(scope="module")
def history(chdb_dsn, tmp_path_factory) -> dict[str, str]:
    """The history corpus (`runwatch scenarios history --quick`: 47 real training runs of one job at
    the commits of a real git repository, over six simulated weeks) stored with its run summaries,
    moved so that its last run started three days ago (telemetry has a 90-day TTL). Returns the run
    ids: "bad" is the first run after the step-time regression (5 normal runs before it)."""
    out = tmp_path_factory.mktemp("grafana-history")
    labels = generate_history(out, quick=True)
    recorded = {run["run_id"]: read_events(out / run["file"]) for run in labels["runs"]}
    last_start = max(events[0].ts for events in recorded.values())
    shift = datetime.now(UTC).replace(microsecond=0) - timedelta(days=3) - last_start
    sink = ClickHouseSink(chdb_dsn)
    try:
        sink.migrate()
        summaries = []
        for run_id, events in recorded.items():
            moved = [e.model_copy(update={"ts": e.ts + shift}) for e in events]
            sink.writer.write_events(moved)
            summarizer = RunSummarizer(run_id, labels["loss_every"])
            for event in moved:
                summarizer.observe(event)
            summaries.append(summarizer.summary())
        sink.writer.write_summaries(summaries)
    finally:
        sink.close()
    step_sync = next(r for r in labels["regressions"] if "step_time_median_s" in r["metrics"])
    return {"bad": step_sync["first_run"]}


@pytest.fixture(scope="module")
def stored(chdb_dsn, nan_demo_run, dist_run, history):
    sink = ClickHouseSink(chdb_dsn)
    yield sink, {"nan": nan_demo_run["run_id"], "dist": dist_run, "bad": history["bad"]}
    sink.close()


@pytest.fixture(scope="module")
def context() -> QueryContext:
    now = datetime.now(UTC)
    start, end = now - timedelta(days=60), now + timedelta(minutes=5)  # the history corpus spans 46 days
    return QueryContext(start, end, interval_for(start, end))


def _run(
    sink: ClickHouseSink, sql: str, ctx: QueryContext, variables: dict
) -> tuple[tuple[str, ...], list[tuple]]:
    """The expanded query's column names (from DESCRIBE, so also for no rows) and rows."""
    expanded = expand(sql.replace("{db}", DATABASE), ctx, variables)
    columns = tuple(row[0] for row in sink.client.query(f"DESCRIBE ({expanded})").result_rows)
    return columns, sink.client.query(expanded).result_rows


def _variables(sink, spec, ctx, run_id: str | None) -> dict:
    """What Grafana would fill in: every option of the multi-value variables (All), the given run,
    each variable's query answering with rows."""
    values: dict = {"metric": "loss", "summary_metric": "final_loss"}
    if run_id is not None:
        values["run"] = run_id
    for var in spec.variables:
        if not var.sql:
            continue
        _, rows = _run(sink, var.sql, ctx, values)
        options = [str(r[0]) for r in rows]
        assert options, f"{spec.uid}: variable ${var.name} lists nothing"
        if var.name == "run":
            assert run_id in options, (spec.uid, run_id, options)
        elif var.multi:
            values[var.name] = options
        elif var.name not in values:
            values[var.name] = options[0]
    return values


def _has_values(rows: list[tuple], columns: tuple[str, ...]) -> bool:
    """A row with a value in a column other than time and the text labels."""
    return any(v is not None for row in rows for name, v in zip(columns, row, strict=True) if name != "time")


# Panels these runs cannot fill, and why (their SQL still runs and must return the panel's columns).
MAY_BE_EMPTY = {
    # a step that some ranks reported and others never did: DDP ranks block together in the gradient
    # all-reduce, so a hung or killed rank stops every rank's step events at the same step
    "Incomplete steps",
    # one annotation per action kind: a run shows only the kinds it got (the nan run's alert and rollback
    # rows are checked in test_the_nan_run_shows_its_finding_and_rollback_on_the_run_dashboard)
    *(f"annotation Actions: {kind}" for kind in ACTION_KINDS),
}

# Which stored runs each dashboard is looked at with (the ones without a run variable: None).
CASES = {
    FLEET.uid: [None],
    PIPELINE.uid: [None],
    RUN_DASHBOARD.uid: ["nan", "dist", "bad"],
    RANKS_DASHBOARD.uid: ["dist"],
    BASELINES_DASHBOARD.uid: ["bad"],
}


@pytest.mark.parametrize("spec", DASHBOARDS, ids=lambda s: s.uid)
def test_every_panel_returns_its_columns_with_rows_on_real_data(stored, context, spec):
    sink, runs = stored
    assert spec.uid in CASES
    shown: dict[str, bool] = {}
    for key in CASES[spec.uid]:
        variables = _variables(sink, spec, context, runs[key] if key else None)
        for item in (*spec.panels, *spec.annotations):
            name = getattr(item, "title", None) or f"annotation {item.name}"
            columns, rows = _run(sink, item.sql, context, variables)
            assert columns == item.columns, (spec.uid, name, key)
            shown[name] = shown.get(name, False) or _has_values(rows, columns)
    empty = [name for name, ok in shown.items() if not ok and name not in MAY_BE_EMPTY]
    assert empty == [], f"{spec.uid}: no rows for {empty}"


def test_the_nan_run_shows_its_finding_and_rollback_on_the_run_dashboard(stored, context, nan_demo_run):
    sink, runs = stored
    variables = _variables(sink, RUN_DASHBOARD, context, runs["nan"])
    marks = {a.name: _run(sink, a.sql, context, variables)[1] for a in RUN_DASHBOARD.annotations}
    fault = nan_demo_run["fault_step"]
    assert any(f"non_finite at step {fault}" in text for _, text, _ in marks["Anomalies"])
    assert [tags for _, _, tags in marks["Rollbacks"]] == [["rollback", "applied"]]
    assert [tags for _, _, tags in marks["Actions: rollback"]] == [["rollback"]]
    assert marks["Actions: alert"] and all(tags == ["alert"] for _, _, tags in marks["Actions: alert"])
    rollback = nan_demo_run["rollbacks"][0]
    assert f"-> {rollback['to_step']}" in marks["Rollbacks"][0][1]
    findings = _run(
        sink, next(p for p in RUN_DASHBOARD.panels if p.title == "Findings").sql, context, variables
    )[1]
    assert len(findings) == len(nan_demo_run["anomalies"])


def test_the_ranks_dashboard_names_the_straggler_and_the_hung_rank(stored, context):
    sink, runs = stored
    variables = _variables(sink, RANKS_DASHBOARD, context, runs["dist"])
    assert variables["rank"] == ["0", "1", "2"]
    by_title = {p.title: p for p in RANKS_DASHBOARD.panels}
    stragglers = _run(sink, by_title["Straggler scores"].sql, context, variables)[1]
    assert {series for _, series, _ in stragglers} == {"rank 2"}
    throttled = _run(sink, by_title["GPU throttle reasons"].sql, context, variables)[1]
    assert {(r[1], r[2]) for r in throttled} == {(2, "sw_thermal_slowdown")}
    hung = _run(sink, by_title["Hung and dead ranks"].sql, context, variables)[1]
    assert [(r[2], r[3], r[4]) for r in hung if r[3] == "hung_rank"] == [(1, "hung_rank", "peers_waiting")]


def test_the_band_panel_is_the_sinks_baseline_band(stored, context):
    sink, runs = stored
    me = sink.baselines.summary(runs["bad"])
    band = sink.baselines.band(me.baseline_key, me.fingerprint, me.started_at, exclude_run=me.run_id)
    assert band is not None and band.n_runs == 5  # the job's five runs before the regression
    compared = 0
    for metric in METRIC_VAR.values:
        variables = {**_variables(sink, BASELINES_DASHBOARD, context, runs["bad"]), "metric": metric}
        rows = _run(sink, BASELINE_BAND.sql, context, variables)[1]
        expected = band.metrics.get(metric)
        if expected is None:  # a figure the job does not report (host RSS: the corpus's runs share a process)
            assert rows == [], metric
            continue
        compared += 1
        assert len(rows) == len(expected.steps), metric  # one row per step of the run (bucket of one step)
        assert [r[2:] for r in rows] == [
            pytest.approx((lo, mid, hi), rel=1e-9)
            for lo, mid, hi in zip(expected.lo, expected.mid, expected.hi, strict=True)
        ], metric
    assert compared >= 4  # loss, grad norm, step time, memory at least


def test_the_outlier_table_gives_the_verdicts_of_baseline_check(stored, context):
    sink, runs = stored
    me = sink.baselines.summary(runs["bad"])
    config = BaselineConfig()
    report = check_run(
        me,
        sink.baselines.candidates(me.baseline_key, me.fingerprint, me.started_at, config.window_days),
        config,
    )
    variables = _variables(sink, BASELINES_DASHBOARD, context, runs["bad"])
    rows = {r[0]: r for r in _run(sink, BASELINE_OUTLIERS.sql, context, variables)[1]}
    assert sorted(rows) == sorted(c.metric for c in report.comparisons)
    for c in report.comparisons:
        metric, last, baseline, low, high, _, n, verdict = rows[c.metric]
        assert (verdict, n) == (c.verdict, c.n), c.metric
        assert (
            baseline == pytest.approx(c.median)
            and low == pytest.approx(c.low)
            and high == pytest.approx(c.high)
        )


def test_the_goodput_panel_is_the_stored_goodput_of_the_nan_run(stored, context):
    from runwatch.sinks.goodput import stored_goodput
    from runwatch.sinks.grafana.panels import RUN_GOODPUT

    sink, runs = stored
    goodput = stored_goodput(sink, runs["nan"])
    assert goodput is not None and goodput.rollback_lost_s > 0
    _, rows = _run(sink, RUN_GOODPUT.sql, context, {"run": runs["nan"]})
    shown = {category: seconds for category, seconds, _ in rows}
    assert shown == pytest.approx(goodput.seconds())
    assert sum(share for _, _, share in rows) == pytest.approx(100.0, abs=0.01)
