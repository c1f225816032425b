"""Goodput (issue 39) of a real run: the `nan` demo (real torch training on the session broker, a real
worker, the sink into the embedded ClickHouse) with a 14-second stall in the train phase at step 40, before
the NaN at step 83 that the worker rolls back. Productive time plus each lost category is the wall time
within 1%; the rollback's lost steps, the stall and the checkpoint saves are each where they should be;
the run's summary carries the goodput `runwatch baseline check` compares."""

from __future__ import annotations

import pytest

from runwatch.contract import topics
from runwatch.sinks import ClickHouseSink
from runwatch.sinks.goodput import LOST, compute_goodput, stored_goodput

pytestmark = pytest.mark.integration

STEPS = 160
STALL_STEP = 40
STALL_S = 14.0  # past the stall detector's train allowance (10 s + 3 median steps)


@pytest.fixture(scope="module")
def stalled_nan_run(broker, action_keys, chdb_dsn, tmp_path_factory) -> dict:
    from runwatch.demo.run import DemoOptions, run_demo

    folder = tmp_path_factory.mktemp("goodput-demo")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.setenv(topics.SIGNING_KEY_ENV, action_keys.pem)
        mp.setenv(topics.PUBLIC_KEYS_ENV, action_keys.public_text)
        report = run_demo(
            DemoOptions(
                scenario="nan",
                steps=STEPS,
                bootstrap=broker.bootstrap,
                dsn=chdb_dsn,
                timeout_s=120,
                stall_step=STALL_STEP,
                stall_s=STALL_S,
            )
        )
    assert len(report["rollbacks"]) == 1 and report["steps_completed"] == STEPS, report
    return report


def test_the_categories_add_up_to_the_wall_time(stalled_nan_run, chdb_dsn):
    run_id = stalled_nan_run["run_id"]
    sink = ClickHouseSink(chdb_dsn)
    goodput = compute_goodput(sink, run_id)
    assert goodput is not None
    seconds = goodput.seconds()
    print({"run_id": run_id, "wall_s": goodput.wall_s, "goodput": goodput.goodput, **seconds})
    named = seconds["productive"] + sum(seconds[c] for c in LOST if c != "other")
    assert abs(named - goodput.wall_s) <= 0.01 * goodput.wall_s, seconds  # without "other": within 1%
    assert abs(goodput.accounted_s() - goodput.wall_s) < 1e-6 * goodput.wall_s  # a partition
    # each category where it should be
    rollback = stalled_nan_run["rollbacks"][0]
    undone = rollback["from_step"] - rollback["to_step"]
    assert goodput.steps_lost >= undone - 1 and seconds["rollback_lost"] > 0
    assert STALL_S - 1.0 <= seconds["stall"] <= STALL_S + 1.0
    assert seconds["checkpoint"] > 0  # a save every 25 steps
    assert seconds["restart_gap"] == 0 and goodput.attempts == 1
    assert 0 < goodput.goodput < 1
    assert any(a["detector"] == "stall" for a in stalled_nan_run["anomalies"])
    # what the demo stored and reported is the same
    stored = stored_goodput(sink, run_id)
    assert stored is not None and stored.seconds() == pytest.approx(seconds, abs=0.01)
    assert stalled_nan_run["goodput"]["seconds"] == pytest.approx(seconds, abs=0.01)
    summary = sink.baselines.summary(run_id)
    assert summary is not None and summary.metrics["goodput_pct"] == pytest.approx(100 * goodput.goodput)
    # the report shows it
    from runwatch.sinks.report import build_report

    html, _ = build_report(sink, run_id)
    assert "<h2>Goodput</h2>" in html and f"goodput <b>{100 * goodput.goodput:.1f}%</b>" in html
    assert "rollback lost" in html and "stall" in html
