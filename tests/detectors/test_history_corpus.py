"""The history corpus end to end: a real git repository, real torch runs over six simulated weeks, and
the gate / change-point scan / in-flight band scored on it (runwatch scenarios history, evaluate,
calibrate)."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from runwatch.cli.main import main as cli
from runwatch.contract.schema import RunStartEvent, StepEvent
from runwatch.detectors.baselines.compare import BaselineConfig
from runwatch.detectors.offline.history_eval import HistoryCorpus, evaluate_history, propose_tolerances
from runwatch.detectors.offline.replay import read_events

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("history")
    result = CliRunner().invoke(cli, ["scenarios", "history", str(out), "--quick"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "[47/47]" in result.output  # a progress line per run
    return out


@pytest.fixture(scope="module")
def labels(corpus_dir: Path) -> dict:
    return json.loads((corpus_dir / "labels.json").read_text())


@pytest.fixture(scope="module")
def corpus(corpus_dir: Path) -> HistoryCorpus:
    return HistoryCorpus(corpus_dir)


@pytest.fixture(scope="module")
def evaluation(corpus_dir: Path) -> dict:
    result = CliRunner().invoke(cli, ["evaluate", str(corpus_dir), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True, timeout=30
    ).stdout


def test_a_real_repository_whose_commits_the_runs_name(
    corpus_dir: Path, labels: dict, corpus: HistoryCorpus
) -> None:
    log = _git(corpus_dir / "repo", "log", "--format=%H %cI %s").splitlines()
    shas = {line.split()[0]: datetime.fromisoformat(line.split()[1]) for line in log}
    assert len(shas) == len({r["commit"] for r in labels["runs"]}) >= 20
    for run in labels["runs"]:
        start = next(e for e in corpus.events[run["run_id"]] if isinstance(e, RunStartEvent))
        assert start.git_sha == run["commit"] and start.git_sha in shas
        assert start.git_dirty is False
        assert datetime.fromisoformat(start.tags["git_commit_time"]) == shas[start.git_sha]
        assert start.baseline_key == labels["baseline_key"]
        assert start.tags["hardware"] == run["fingerprint"]
    # one small file changed per commit
    for sha in shas:
        changed = _git(corpus_dir / "repo", "show", "--name-only", "--format=", sha).split()
        assert len(changed) == 1 and changed[0] in ("train_config.json", "NOTES.md")


def test_thirty_days_of_runs_on_two_fingerprints_with_real_figures(
    labels: dict, corpus: HistoryCorpus
) -> None:
    runs = labels["runs"]
    assert len(runs) >= 30
    starts = sorted(
        next(e for e in corpus.events[r["run_id"]] if isinstance(e, RunStartEvent)).ts for r in runs
    )
    assert (starts[-1] - starts[0]).days >= 30
    assert {r["fingerprint"] for r in runs} == {"cpu-a", "cpu-b"}
    steps = [e for e in corpus.events[runs[0]["run_id"]] if isinstance(e, StepEvent)]
    assert len(steps) == labels["steps"]
    assert all(s.step_time_s and s.mfu and s.memory and s.memory.peak for s in steps)
    assert any(e.kind == "eval" for e in corpus.events[runs[0]["run_id"]])


def test_every_labelled_regression_found_at_its_commit(evaluation: dict, labels: dict) -> None:
    by_name = {r["name"]: r for r in evaluation["regressions"]}
    assert len(by_name) == len(labels["regressions"]) >= 6
    for reg in evaluation["regressions"]:
        if reg["in_flight"]:
            continue
        assert reg["found_metrics"], reg  # the gate: an OUTLIER on a labelled metric of the first run
        assert reg["gate_exit_code"] == 1
        assert reg["commit_range_contains"], reg  # last normal run's commit .. this run's holds it
        assert reg["commit_named_correctly"], reg  # the change-point scan names the commit
        assert reg["later_runs_flagged"] == reg["later_runs"]
    assert "step_time_median_s" in by_name["step-sync"]["found_metrics"]
    assert "mfu" in by_name["micro-batch-12"]["found_metrics"]
    assert "step_time_median_s" not in by_name["micro-batch-12"]["found_metrics"]
    summary = evaluation["summary"]
    assert summary["commits_named_correctly"] == summary["regressions"]
    assert summary["scan_false_alarms"] == 0


def test_the_randn_init_is_found_in_flight(evaluation: dict) -> None:
    randn = next(r for r in evaluation["regressions"] if r["name"] == "randn-mel-scale")
    assert randn["in_flight"] and randn["found"]
    assert randn["in_flight_status"] == "found" and "(root)" in randn["in_flight_finding"]


def test_benign_commits_and_insufficient_history(evaluation: dict, labels: dict) -> None:
    assert evaluation["false_alarms"] == [] and evaluation["summary"]["false_alarms"] == 0
    runs = {r["run_id"]: r for r in evaluation["runs"]}
    ordered = [r["run_id"] for r in labels["runs"]]
    insufficient = set(evaluation["insufficient_history"])
    assert set(ordered[:5]) <= insufficient  # the job's first runs
    assert ordered[5] not in insufficient
    move = [r["run_id"] for r in labels["runs"] if r["fingerprint"] == "cpu-b"]
    assert set(move[:5]) <= insufficient and move[5] not in insufficient  # the move to cpu-b starts afresh
    declared = next(r for r in labels["runs"] if r["new_baseline"])["run_id"]
    after = ordered[ordered.index(declared) :]
    assert set(after[:5]) <= insufficient  # the declared new baseline starts afresh too
    assert all(runs[r]["exit_code"] == 0 for r in after)  # slower by design: no outlier


def test_calibrated_tolerances_leave_no_false_alarm(
    corpus_dir: Path, corpus: HistoryCorpus, tmp_path: Path
) -> None:
    out = tmp_path / "tolerances.yaml"
    result = CliRunner().invoke(
        cli, ["calibrate", str(corpus_dir), "--out", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    min_change = yaml.safe_load(out.read_text())["baseline"]["min_change"]
    assert min_change["category_loss_silence"] > 0.05 and min_change["max_cuda_peak_bytes"] >= 0.01
    assert {p.metric for p in propose_tolerances(corpus)} == set(min_change)
    evaluation = evaluate_history(corpus, BaselineConfig(min_change=min_change), in_flight=False)
    assert evaluation.summary["false_alarms"] == 0
    assert all(r.found_metrics for r in evaluation.regressions if not r.in_flight)
    assert evaluation.summary["commits_named_correctly"] == evaluation.summary["regressions"]


def test_the_per_run_files_are_plain_jsonl(corpus_dir: Path, labels: dict) -> None:
    events = read_events(corpus_dir / labels["runs"][0]["file"])
    assert events[0].kind == "run_start" and events[-1].kind == "run_end"
