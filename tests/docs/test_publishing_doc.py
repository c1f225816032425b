"""The shell examples of docs/publishing-without-python.md build a valid event, without a broker:
each block runs as it stands with its client (node, kcat) replaced by a stub that records its
arguments and standard input. tests/contract/test_non_python_client.py runs them for real."""

from __future__ import annotations

import math
import os
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from runwatch.contract.schema import REQUIRED_FIELDS, decode_event

DOC = Path(__file__).resolve().parents[2] / "docs" / "publishing-without-python.md"
BLOCKS = {
    "node": "<!-- executed by tests/contract/test_non_python_client.py -->",
    "kcat": "<!-- kcat: executed by tests/contract/test_non_python_client.py -->",
}
STUB = '#!/bin/sh\nprintf "%s\\n" "$@" > "$STUB_OUT.args"\ncat > "$STUB_OUT.stdin"\n'


def run_block(client: str, tmp_path: Path, loss: str | None = None) -> tuple[list[str], str]:
    block = re.search(re.escape(BLOCKS[client]) + r"\n```sh\n(.*?)```", DOC.read_text(), flags=re.S).group(1)
    if loss is not None:
        assert block.count("LOSS=2.5") == 1
        block = block.replace("LOSS=2.5", f"LOSS={loss}")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / client).write_text(STUB)
    (bin_dir / client).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_OUT": str(tmp_path / "stub"),
        "RUNWATCH_BOOTSTRAP": "127.0.0.1:19092",
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return (tmp_path / "stub.args").read_text().splitlines(), (tmp_path / "stub.stdin").read_text()


def check_message(line: str):
    key, value = line.rstrip("\n").split("|", 1)
    data = orjson.loads(value)
    assert set(REQUIRED_FIELDS) | {"step"} <= data.keys()
    assert data["schema_version"] == 1 and type(data["rank"]) is int and type(data["step"]) is int
    event = decode_event(value)
    assert event.kind == "step" and event.run_id == key == "run-42"
    assert event.ts.tzinfo is not None and abs((datetime.now(UTC) - event.ts).total_seconds()) < 30
    assert re.fullmatch(r"[0-9a-f]{32}", event.event_id)
    return event


@pytest.mark.parametrize("client", ["node", "kcat"])
def test_documented_block_sends_one_valid_step_event_keyed_by_run_id(client, tmp_path):
    args, stdin = run_block(client, tmp_path)
    assert stdin.count("\n") == 1
    event = check_message(stdin)
    assert event.step == 1 and event.loss == 2.5
    if client == "kcat":
        assert args[args.index("-X") + 1] == "partitioner=murmur2_random"
        assert "-K|" in args and args[args.index("-t") + 1] == "runwatch.telemetry"
        assert args[args.index("-b") + 1] == "127.0.0.1:19092"
    else:
        assert args == ["runwatch-publish.js"]
        script = (tmp_path / "runwatch-publish.js").read_text()
        assert "createPartitioner: Partitioners.DefaultPartitioner" in script
        assert '"runwatch.telemetry"' in script and "process.env.RUNWATCH_BOOTSTRAP" in script


def test_each_run_of_the_block_gets_a_new_event_id(tmp_path):
    ids = set()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        ids.add(check_message(run_block("node", tmp_path / name)[1]).event_id)
    assert len(ids) == 2


def test_nan_loss_as_documented(tmp_path):
    _, stdin = run_block("node", tmp_path, loss="'\"NaN\"'")
    assert math.isnan(check_message(stdin).loss)
