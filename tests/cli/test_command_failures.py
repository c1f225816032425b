"""Every expected failure of every command, as docs/operations.md's table lists it (issue 26): the table
is run as written. Each row's command exits with its code and prints exactly its one line on stderr;
no output holds a traceback or the password `s3cret` given in a URL. A row that needs a store gets one
(`runwatch migrate` into ./store), a row that needs "the keys" gets the workers' action signing key, its
public key and a state key."""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.action_keys import UNIT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "operations.md"
SETUPS = ("an empty folder", "a store", "the keys")
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RUNWATCH_")}
KEYS = {
    **UNIT.worker_env,
    **UNIT.trainer_env,
    "RUNWATCH_STATE_SECRET": "a-test-state-key-of-at-least-thirty-two-bytes",
}
PASSWORD = "s3cret"
RUNWATCH = str(Path(sys.executable).with_name("runwatch"))  # the command as a user types it


@dataclass(frozen=True)
class Row:
    command: str
    setup: str
    code: int
    line: str

    def pattern(self, **values: str) -> re.Pattern[str]:
        text = self.line.format(**values) if "{" in self.line else self.line
        return re.compile(".*".join(re.escape(part) for part in text.split("…")))


def rows(text: str) -> list[Row]:
    """The rows of the "Expected failures" table."""
    section = text.split("### Expected failures", 1)[1].split("\n#", 1)[0]
    found = []
    for line in section.splitlines():
        m = re.fullmatch(r"\| `(runwatch [^`]*)` \| ([^|]+) \| (\d) \| `(.*)` \|", line.strip())
        if m:
            found.append(Row(m.group(1), m.group(2).strip(), int(m.group(3)), m.group(4)))
    return found


def test_the_table_is_read_whole():
    table = rows(DOC.read_text())
    section = DOC.read_text().split("### Expected failures", 1)[1].split("\n#", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| `runwatch")]
    assert len(table) == len(lines) >= 25  # no row the pattern above would skip
    assert {r.setup for r in table} <= set(SETUPS)
    # every command has at least one row
    commands = {" ".join(r.command.split()[1:3]) for r in table}
    for name in (
        "up",
        "runs",
        "report",
        "baseline check",
        "baseline scan",
        "migrate",
        "sink",
        "worker",
        "remediate",
        "broker",
        "ingest",
        "replay",
        "evaluate",
        "calibrate",
        "config",
        "scenarios generate",
        "demo",
        "grafana generate",
        "grafana provision",
    ):
        assert any(c == name or c.split()[0] == name for c in commands), name


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("with-store")
    done = subprocess.run(
        [sys.executable, "-m", "runwatch.cli", "migrate", "--dsn", "chdb://store"],
        cwd=folder,
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    return folder


READ_ONLY = ("runwatch runs", "runwatch report", "runwatch baseline")


def _run(row: Row, cwd: Path, busy_port: int) -> tuple[Row, Path, subprocess.CompletedProcess[str]]:
    env = dict(CLEAN_ENV, **(KEYS if row.setup == "the keys" else {}))
    argv = shlex.split(row.command.format(busy_port=busy_port))[1:]
    done = subprocess.run(
        [RUNWATCH, *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return row, cwd, done


def test_every_expected_failure_is_its_one_line(store_dir, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        jobs = []
        for i, row in enumerate(rows(DOC.read_text())):
            if row.setup == "a store":
                cwd = store_dir
            else:
                cwd = tmp_path / f"row{i}"
                cwd.mkdir()
            jobs.append((row, cwd))
        # (the broker rows wait out the 20 s connect deadline: run them side by side; the rows on the store
        # one after the other, since an embedded store takes one process at a time)
        on_store = [job for job in jobs if job[1] == store_dir]
        elsewhere = [job for job in jobs if job[1] != store_dir]
        with ThreadPoolExecutor(max_workers=4) as pool:
            results = list(pool.map(lambda job: _run(job[0], job[1], port), elsewhere))
        results += [_run(row, cwd, port) for row, cwd in on_store]
    problems = []
    for row, cwd, done in results:
        said = [line for line in done.stderr.splitlines() if line.strip()]
        output = done.stdout + done.stderr
        if done.returncode != row.code:
            problems.append(f"{row.command}: exit {done.returncode}, not {row.code}: {said[-3:]}")
        if len(said) != 1 or not row.pattern(busy_port=str(port)).fullmatch(said[0]):
            problems.append(f"{row.command}: said {said[-5:]!r}, not {row.line!r}")
        if "Traceback" in output:
            problems.append(f"{row.command}: a traceback")
        if PASSWORD in output:
            problems.append(f"{row.command}: printed the password")
        if row.command.startswith(READ_ONLY) and cwd != store_dir and (cwd / ".runwatch").exists():
            problems.append(f"{row.command}: made .runwatch/ where it ran")
    assert problems == [], "\n".join(problems)
