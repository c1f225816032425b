"""The product's front door: `runwatch demo --json` end to end, each scenario, in its own
working directory, with the embedded broker, a real Faust worker, real torch and chdb."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

STEPS = 160


def run_demo(scenario: str, cwd, *options: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RUNWATCH_ACTION_") and k != "RUNWATCH_BOOTSTRAP"
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runwatch.cli",
            "demo",
            "--scenario",
            scenario,
            "--steps",
            str(STEPS),
            "--json",
            *options,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def assert_nothing_lost(report: dict) -> None:
    assert report["events_dropped"] == 0
    assert report["events_published"] > STEPS
    assert report["clickhouse"]["telemetry_rows"] == report["events_published"]


def test_nan_is_found_at_its_step_and_rolled_back_once(tmp_path):
    report = run_demo("nan", tmp_path)
    fault = report["fault_step"]
    non_finite = [a for a in report["anomalies"] if a["detector"] == "non_finite"]
    assert non_finite and non_finite[0]["step"] == fault  # delay 0
    assert len(report["rollbacks"]) == 1
    rollback = report["rollbacks"][0]
    assert rollback["to_step"] <= fault < rollback["from_step"]
    assert [a["kind"] for a in report["actions"]].count("rollback") == 1
    assert report["steps_completed"] == STEPS and not report["stopped"]
    assert math.isfinite(report["final_loss"])
    assert report["nonfinite_steps_after_last_rollback"] == 0
    assert report["clickhouse"]["anomalies"] == len(report["anomalies"])
    assert report["clickhouse"]["actions"] == len(report["actions"])
    assert_nothing_lost(report)
    # The rollback restored a checkpoint the trainer registered before the fault.
    assert (
        tmp_path / ".runwatch" / "checkpoints" / report["run_id"] / f"step-{rollback['to_step']:06d}.pt"
    ).exists()


def test_grad_spike_is_skipped_by_the_step_guard_and_needs_no_rollback(tmp_path):
    """A batch 200x out of range: the trainer's step guard skips its update before it lands (issue 37).
    The spike is still found at its step, as info (the weights never saw it); nothing is rolled back."""
    report = run_demo("grad-spike", tmp_path)
    fault = report["fault_step"]
    found = [a for a in report["anomalies"] if abs(a["step"] - fault) <= 1]
    assert any(a["detector"] == "grad_norm_spike" for a in found), report["anomalies"]
    assert any(a["detector"] == "skipped_updates" and a["step"] == fault for a in found)
    assert all(a["severity"] == "info" for a in found)
    assert report["rollbacks"] == [] and report["actions"] == []
    assert report["steps_completed"] == STEPS and math.isfinite(report["final_loss"])
    assert_nothing_lost(report)


def test_healthy_run_raises_nothing(tmp_path):
    report = run_demo("healthy", tmp_path)
    assert report["fault_step"] is None
    assert report["anomalies"] == [] and report["actions"] == [] and report["rollbacks"] == []
    assert report["steps_completed"] == STEPS
    assert_nothing_lost(report)


def test_a_recorded_fault_scenario_runs_live_and_is_caught(tmp_path):
    report = run_demo("stall_hang_train", tmp_path)  # a 3-minute hang, on a simulated clock
    stalls = [a for a in report["anomalies"] if a["detector"] == "stall"]
    assert stalls and stalls[0]["step"] == report["fault_step"]
    assert {a["detector"] for a in report["anomalies"]} == {"stall"}  # nothing else cried wolf
    assert report["events_dropped"] == 0
    assert report["clickhouse"]["telemetry_rows"] == report["events_published"]


def test_a_recorded_fault_scenario_takes_its_actions_through_a_broker_outage(tmp_path):
    """Any catalog scenario runs live: a corpus NaN scenario, with every client cut off the broker for
    the middle third, is rolled back by the worker's actions and loses no event."""
    # 0.05 s a step: the outage (a third of its 300 steps) outlasts the 3 s delivery timeout, so the
    # trainer's events go to its spool (a shorter one is ridden out by the Kafka client's retries)
    report = run_demo("nan_loss_mlp", tmp_path, "--broker-outage", "0.33:0.66", "--step-interval", "0.05")
    fault = report["fault_step"]
    non_finite = [a for a in report["anomalies"] if a["detector"] == "non_finite"]
    assert non_finite and non_finite[0]["step"] == fault
    assert report["rollbacks"], report["actions"]
    assert all(r["to_step"] < fault for r in report["rollbacks"])  # to a checkpoint confirmed before it
    assert report["spool"]["spooled"] > 0  # the outage happened, and the spool carried it
    assert report["events_dropped"] == 0
    assert report["clickhouse"]["telemetry_rows"] == report["events_published"]


def test_an_unknown_scenario_is_refused_with_the_choices(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "runwatch.cli", "demo", "--scenario", "no-such-thing"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "stall_hang_train" in proc.stderr and "grad-spike" in proc.stderr
