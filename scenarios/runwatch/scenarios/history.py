"""The history corpus: one job's runs over six simulated weeks, each at a commit of a real git repository.

``runwatch scenarios history DIR`` writes

* ``DIR/repo``: a real git repository, one commit per entry of :data:`.history_catalog.COMMITS`, each
  changing one small file (``train_config.json`` or ``NOTES.md``), author and committer dates set to
  the simulated day;
* ``DIR/runs/<run_id>.jsonl``: one real training run (:func:`.training.run_scenario`, real torch)
  per run day of each commit, recorded on a :class:`SimulatedClock` that starts on that day, so the
  runs span the whole period. ``run_start`` carries the commit's real sha, ``git_dirty`` False, the
  baseline key and the tags ``hardware`` (the declared fingerprint), ``git_commit_time``,
  ``peak_flops_per_s`` and, on the first run of a declared new baseline, ``new_baseline``;
* ``DIR/labels.json``: ``kind: history``, the runs (commit, day, fingerprint, the change), the labelled
  regressions (commit, metrics, first run) and the benign commits.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from runwatch.scenarios.clocks import SimulatedClock
from runwatch.scenarios.history_catalog import (
    BASELINE_KEY,
    COMMITS,
    CONFIG_FILE,
    LOSS_AT_STEPS,
    NOTES_FILE,
    Commit,
)
from runwatch.scenarios.history_job import HARDWARE, DeclaredHardwareRecorder, JobConfig, job_scenario
from runwatch.scenarios.training import run_scenario

HISTORY_START = datetime(2025, 3, 3, tzinfo=UTC)  # day 0, midnight
COMMIT_HOUR = 8  # commits land at 08:00 on their day, runs start at 21:00 (nightly)
RUN_HOUR = 21
AUTHOR = ("Runwatch Corpus", "corpus@runwatch.invalid")


@dataclass(frozen=True)
class HistorySize:
    """Steps per run and the cadence of evals, checkpoints and ``loss_at_step_N``."""

    steps: int
    loss_every: int
    eval_every: int


FULL = HistorySize(steps=300, loss_every=100, eval_every=50)
QUICK = HistorySize(steps=60, loss_every=20, eval_every=20)


@dataclass
class RecordedRun:
    run_id: str
    file: str
    commit: str  # the sha
    commit_name: str
    day: int
    fingerprint: str  # the declared hardware
    change: str
    new_baseline: bool
    seconds: float  # wall time to record it


class GitRepo:
    """The job's repository: ``git`` itself, with every commit's dates set to its simulated day."""

    def __init__(self, path: Path):
        self.path = path

    def git(self, *args: str, when: datetime | None = None) -> str:
        env = {
            **os.environ,
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_AUTHOR_NAME": AUTHOR[0],
            "GIT_AUTHOR_EMAIL": AUTHOR[1],
            "GIT_COMMITTER_NAME": AUTHOR[0],
            "GIT_COMMITTER_EMAIL": AUTHOR[1],
        }
        if when is not None:
            env["GIT_AUTHOR_DATE"] = env["GIT_COMMITTER_DATE"] = when.isoformat()
        done = subprocess.run(
            ["git", *args], cwd=self.path, env=env, capture_output=True, text=True, timeout=60
        )
        if done.returncode != 0:
            raise RuntimeError(f"git {' '.join(args)} failed in {self.path}: {done.stderr.strip()}")
        return done.stdout.strip()

    def init(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.git("init", "--quiet", "--initial-branch=main")

    def commit(self, file: str, text: str, message: str, when: datetime) -> str:
        (self.path / file).write_text(text)
        self.git("add", file)
        self.git("commit", "--quiet", "-m", message, when=when)
        return self.git("rev-parse", "HEAD")


def _config_json(config: JobConfig, extra: dict[str, Any]) -> str:
    return json.dumps({**config.to_json(), **extra}, indent=2, sort_keys=True) + "\n"


def _apply(
    config: JobConfig, extra: dict[str, Any], changes: dict[str, Any]
) -> tuple[JobConfig, dict[str, Any]]:
    """A commit's changes: JobConfig fields (None: back to the default) and other keys (``pool``)."""
    known: dict[str, Any] = {f.name: f.default for f in fields(JobConfig)}
    updates = {k: (known[k] if v is None else v) for k, v in changes.items() if k in known}
    extra = {**extra, **{k: v for k, v in changes.items() if k not in known}}
    return replace(config, **updates), extra


def expand_metrics(metrics: tuple[str, ...], size: HistorySize) -> list[str]:
    """The labelled metric names, ``loss_at_step_*`` expanded to the steps the runs record."""
    out: list[str] = []
    for m in metrics:
        if m == LOSS_AT_STEPS:
            out += [f"loss_at_step_{n}" for n in range(size.loss_every, size.steps, size.loss_every)]
        else:
            out.append(m)
    return out


def generate(
    out_dir: str | Path,
    *,
    quick: bool = False,
    progress: Callable[[RecordedRun, int, int], None] | None = None,
) -> dict[str, Any]:
    """Create the repository, record every run and write ``labels.json``; returns the labels."""
    out = Path(out_dir)
    repo = GitRepo(out / "repo")
    if (repo.path / ".git").exists():
        raise FileExistsError(f"{repo.path} is already a git repository: give an empty directory")
    repo.init()
    (out / "runs").mkdir(parents=True, exist_ok=True)
    size = QUICK if quick else FULL
    config = JobConfig()
    extra: dict[str, Any] = {}
    notes = "# Notes on the audio job\n"
    total = sum(len(c.run_days) for c in COMMITS)
    runs: list[RecordedRun] = []
    regressions: list[dict[str, Any]] = []
    benign: list[dict[str, Any]] = []
    for commit in COMMITS:
        when = HISTORY_START + timedelta(days=commit.day, hours=COMMIT_HOUR)
        if commit.note is not None:
            notes += f"\n{commit.note}\n"
            sha = repo.commit(NOTES_FILE, notes, commit.message, when)
        else:
            config, extra = _apply(config, extra, commit.config)
            sha = repo.commit(CONFIG_FILE, _config_json(config, extra), commit.message, when)
        first_run = None
        for i, day in enumerate(commit.run_days):
            run = _record(out, commit, sha, when, config, day, len(runs), i == 0, size)
            first_run = first_run or run.run_id
            runs.append(run)
            if progress is not None:
                progress(run, len(runs), total)
        entry = {
            "commit": sha,
            "name": commit.name,
            "day": commit.day,
            "description": commit.description,
            "message": commit.message,
            "first_run": first_run,
        }
        if commit.kind == "regression":
            regressions.append(
                {**entry, "metrics": expand_metrics(commit.metrics, size), "in_flight": commit.in_flight}
            )
        elif commit.kind != "initial":
            benign.append({**entry, "kind": commit.kind})
    labels = {
        "kind": "history",
        "baseline_key": BASELINE_KEY,
        "quick": quick,
        "steps": size.steps,
        "loss_every": size.loss_every,
        "eval_every": size.eval_every,
        "window_days": 30,
        "start": HISTORY_START.isoformat(),
        "hardware": HARDWARE,
        "runs": [{k: v for k, v in asdict(r).items() if k != "seconds"} for r in runs],
        "regressions": regressions,
        "benign": benign,
    }
    (out / "labels.json").write_text(json.dumps(labels, indent=2) + "\n")
    return labels


def _record(
    out: Path,
    commit: Commit,
    sha: str,
    committed: datetime,
    config: JobConfig,
    day: int,
    index: int,
    first_at_commit: bool,
    size: HistorySize,
) -> RecordedRun:
    started = time.perf_counter()
    run_id = f"history-{index:03d}-d{day:02d}-{commit.name}"
    clock = SimulatedClock(start=HISTORY_START + timedelta(days=day, hours=RUN_HOUR, minutes=7 * (index % 5)))
    noise_seed = config.augment_seed_base + index
    new_baseline = commit.kind == "new_baseline" and first_at_commit
    hardware = HARDWARE[commit.hardware]
    tags = {
        "hardware": commit.hardware,
        "git_commit_time": committed.isoformat(),
        "peak_flops_per_s": f"{hardware['peak_flops_per_s']:g}",
        "commit": commit.name,
        "memory_model": "emulated-caching-allocator",
    }
    if new_baseline:
        tags["new_baseline"] = "true"
    path = out / "runs" / f"{run_id}.jsonl"
    rec = DeclaredHardwareRecorder(
        path,
        run_id,
        clock=clock.now,
        collect_metadata=False,
        seed=config.seed,
        config=config.to_json(),
        tags=tags,
        baseline_key=BASELINE_KEY,
        job_id="audio-classifier",
        run_start={
            "git_sha": sha,
            "git_dirty": False,
            "host": f"{commit.hardware}-01",
            "config_hash": _config_hash(config),
        },
        peak_flops_per_s=hardware["peak_flops_per_s"],
        batch=config.batch,
    )
    sc = job_scenario(config, commit.hardware, noise_seed, size.steps, size.loss_every, size.eval_every)
    outcome = run_scenario(sc, rec, clock)
    rec.close(status=outcome.status, summary={"steps": outcome.steps})
    return RecordedRun(
        run_id=run_id,
        file=f"runs/{path.name}",
        commit=sha,
        commit_name=commit.name,
        day=day,
        fingerprint=commit.hardware,
        change=commit.message,
        new_baseline=new_baseline,
        seconds=time.perf_counter() - started,
    )


def _config_hash(config: JobConfig) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(config.to_json(), sort_keys=True).encode()).hexdigest()[:16]
