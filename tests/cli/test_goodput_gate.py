"""`runwatch baseline check` on goodput (issue 39): a job's history of runs stored by the sink's writer and
summarised as the sink summarises them (their goodput computed in ClickHouse and put in the summary), then
a run that spends a fifth of its time saving checkpoints between the same steps. Its step times are no
worse (shorter, in fact), its wall time the same: only its goodput tells, and the gate exits 1 on it; a
normal run passes, and a `goodput_points` tolerance larger than the drop lets the slow run pass too."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner

from runwatch.cli.main import main
from runwatch.contract.schema import RunEndEvent, RunStartEvent, StepEvent
from runwatch.sinks import ClickHouseSink
from runwatch.sinks.summaries import summarize_stored_run

pytestmark = pytest.mark.integration

STEPS = 60


def store_run(
    sink: ClickHouseSink, run_id: str, key: str, start: datetime, *, save_share: float, jitter: float
):
    """One run: STEPS steps of 1 s wall each, ``save_share`` of every step's second spent in a checkpoint
    save (off-step), the rest its step time."""
    events: list = [RunStartEvent(run_id=run_id, ts=start, baseline_key=key, job_id=key, host="node-1")]
    t = start + timedelta(seconds=2)
    for step in range(1, STEPS + 1):
        save = save_share * (1 + jitter)
        t += timedelta(seconds=1.0)
        off = {"checkpoint": save} if save > 0 else None
        events.append(StepEvent(run_id=run_id, ts=t, step=step, step_time_s=1.0 - save, data_wait_s=0.0,
                                off_step_s=off, loss=1.0 / step))  # fmt: skip
    events.append(RunEndEvent(run_id=run_id, ts=t + timedelta(seconds=0.5), status="completed"))
    sink.writer.write_events(events)
    return summarize_stored_run(sink, run_id)


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_the_gate_fails_a_run_whose_goodput_fell(chdb_dsn, tmp_path):
    sink = ClickHouseSink(chdb_dsn)
    sink.migrate()
    key = f"gp-{uuid.uuid4().hex[:8]}"
    start = datetime.now(UTC) - timedelta(days=10)
    for i in range(6):
        summary = store_run(
            sink, f"{key}-h{i}", key, start + timedelta(days=i), save_share=0.02, jitter=i / 10
        )
        assert summary.metrics["goodput_pct"] == pytest.approx(
            100 * 60 * (1 - 0.02 * (1 + i / 10)) / 62.5, abs=0.1
        )
    slow = store_run(sink, f"{key}-slow", key, start + timedelta(days=7), save_share=0.2, jitter=0)
    normal = store_run(sink, f"{key}-ok", key, start + timedelta(days=8), save_share=0.02, jitter=0.05)
    assert slow.metrics["goodput_pct"] < normal.metrics["goodput_pct"] - 15

    failed = invoke("baseline", "check", slow.run_id, "--dsn", chdb_dsn, "--json")
    report = json.loads(failed.output)
    assert failed.exit_code == 1 and report["outliers"] == ["goodput_pct"], failed.output
    verdict = next(c for c in report["comparisons"] if c["metric"] == "goodput_pct")
    assert verdict["n"] == 6 and "points below the history's median" in verdict["reason"]

    passed = invoke("baseline", "check", normal.run_id, "--dsn", chdb_dsn)
    assert passed.exit_code == 0, passed.output
    assert "goodput_pct" in passed.output

    tolerant = tmp_path / "tolerant.yaml"
    tolerant.write_text("baseline:\n  goodput_points: 25\n")
    let_through = invoke("baseline", "check", slow.run_id, "--dsn", chdb_dsn, "--config", str(tolerant))
    assert let_through.exit_code == 0, let_through.output
