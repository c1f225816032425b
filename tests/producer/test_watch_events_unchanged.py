"""What the watcher publishes is what it published before the host-cost work of issue 40 (commit 2ffb10c):
seeded runs recorded with that commit's runwatch and with this checkout's, event by event and field by
field, apart from ``event_id`` (tests/benchmarks/record_seeded_run.py: the hooks path with clipping, the
guard, update norms, activations and replica digests, through the JSONL recorder and through the Kafka
delivery's publisher thread; a hand-written update; no guard). Skipped where the commit is not in the
repository (a shallow clone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "2ffb10c"
ROOMS = ("contract", "producer", "detectors", "streams", "sinks", "cli", "local", "demo", "scenarios")
SCRIPT = ROOT / "tests" / "benchmarks" / "record_seeded_run.py"

sys.path.insert(0, str(SCRIPT.parent))
from record_seeded_run import RUNS, comparable, differences  # noqa: E402


def _has_commit() -> bool:
    found = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{BEFORE}^{{commit}}"], capture_output=True, check=False
    )
    return found.returncode == 0


def _record(out: Path, pythonpath: str) -> None:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], env=env, check=True, timeout=300, capture_output=True
    )


@pytest.mark.skipif(not _has_commit(), reason=f"commit {BEFORE} is not in this repository")
def test_the_seeded_runs_publish_the_same_events_as_before(tmp_path):
    old = tmp_path / "old"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), BEFORE], check=True
    )
    try:
        _record(tmp_path / "before", os.pathsep.join(str(old / room) for room in ROOMS))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    _record(
        tmp_path / "now",
        os.pathsep.join([*(str(ROOT / room) for room in ROOMS), os.environ.get("PYTHONPATH", "")]),
    )
    for name in RUNS:
        before = comparable(tmp_path / "before" / f"{name}.jsonl")
        now = comparable(tmp_path / "now" / f"{name}.jsonl")
        assert len(before) > 40, name
        assert differences(before, now) == [], name
