"""docs/offline-recording.md as it stands: its Python block records a real torch loop (a NaN
batch at step 250) with ``JsonlRecorder`` exported from ``runwatch.producer``, and its shell block
replays the file with the real ``runwatch replay`` CLI, which finds the poisoned batch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import runwatch.producer
from runwatch.contract.schema import decode_event

pytestmark = pytest.mark.integration  # starts processes (issue 25: not in `make test-fast`)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "offline-recording.md"
MARK = "<!-- executed by tests/producer/test_offline_recording_doc.py -->"


def block(lang: str) -> str:
    found = re.findall(re.escape(MARK) + r"\n```" + lang + r"\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(found) == 1, f"one executed {lang} block expected in {DOC.name}"
    return found[0]


def test_jsonl_recorder_is_exported():
    assert "JsonlRecorder" in runwatch.producer.__all__
    from runwatch.producer import JsonlRecorder
    from runwatch.producer.publish.recorder import JsonlRecorder as Defined

    assert JsonlRecorder is Defined


def test_the_documented_recording_replays_and_the_nan_is_found(tmp_path):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "RUNWATCH_SPOOL_DIR": str(tmp_path / "spool"),
    }
    (tmp_path / "record.py").write_text(block("python"))
    done = subprocess.run(
        [sys.executable, "record.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr

    events = [decode_event(line) for line in (tmp_path / "run.jsonl").read_bytes().splitlines()]
    kinds = [e.kind for e in events]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and kinds.count("step") == 300
    assert events[-1].status == "completed"
    steps = [e for e in events if e.kind == "step"]
    assert all(s.grad_norm is not None and s.step_time_s is not None for s in steps)
    assert steps[249].loss == steps[249].loss and steps[250].loss != steps[250].loss  # NaN from step 250

    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block("sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"run.jsonl: {len(events)} events (300 steps) in 1 run(s)" in done.stdout
    assert re.search(r"│ 250\s+│ 0\s+│ non_finite\s+│", done.stdout), done.stdout

    report = json.loads((tmp_path / "findings.json").read_text())
    assert (report["events"], report["steps"], report["runs"]) == (len(events), 300, ["offline-demo"])
    non_finite = [a for a in report["anomalies"] if a["detector"] == "non_finite"]
    assert non_finite and non_finite[0]["step"] == 250 and non_finite[0]["evidence"]["onset_step"] == 250
    assert all(a["step"] >= 250 for a in report["anomalies"] if a["detector"] != "throughput_drift")
    assert report["actions"], "the policy acts on a non-finite run"
