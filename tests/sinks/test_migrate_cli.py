"""`runwatch migrate`: waits for ClickHouse, applies the migrations once, never prints the password."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner
from clickhouse_connect.driver.exceptions import OperationalError

import runwatch.sinks
from runwatch.cli.main import main as cli
from runwatch.sinks.migrations import MIGRATIONS


class FakeStore:
    """Stands in for ClickHouseSink: refuses the first ``refusals`` connections, like a server still
    starting."""

    refusals = 0
    attempts = 0
    migrated = 0

    def __init__(self, dsn: str | None):
        FakeStore.attempts += 1
        if FakeStore.attempts <= FakeStore.refusals:
            raise OperationalError("connection refused")
        self.dsn = dsn

    def migrate(self) -> list[int]:
        FakeStore.migrated += 1
        return [m.version for m in MIGRATIONS]

    def schema_version(self) -> int:
        return MIGRATIONS[-1].version

    def close(self) -> None:
        pass


@pytest.fixture
def fake_store(monkeypatch):
    monkeypatch.setattr(runwatch.sinks, "ClickHouseSink", FakeStore)
    monkeypatch.setattr("time.sleep", lambda _s: None)
    FakeStore.attempts = FakeStore.migrated = 0
    return FakeStore


def test_waits_for_the_server_then_migrates_without_printing_the_password(fake_store):
    fake_store.refusals = 2
    result = CliRunner().invoke(
        cli, ["migrate", "--dsn", "http://runwatch:s3cret@clickhouse:8123", "--wait", "60"]
    )
    assert result.exit_code == 0, result.output
    assert fake_store.attempts == 3 and fake_store.migrated == 1
    assert f"schema v{MIGRATIONS[-1].version}" in result.output
    assert "s3cret" not in result.output and "runwatch:***@clickhouse:8123" in result.output


def test_gives_up_after_wait(fake_store):
    fake_store.refusals = 10**9
    result = CliRunner().invoke(cli, ["migrate", "--dsn", "http://u:p@nowhere:8123", "--wait", "0"])
    assert result.exit_code == 2
    assert "did not answer within 0 s" in result.output
    assert fake_store.migrated == 0


def test_dsn_from_the_environment(fake_store, monkeypatch):
    fake_store.refusals = 0
    monkeypatch.setenv("RUNWATCH_CLICKHOUSE_DSN", "http://runwatch:pw@clickhouse:8123")
    result = CliRunner().invoke(cli, ["migrate"])
    assert result.exit_code == 0, result.output
    assert "runwatch:***@clickhouse:8123" in result.output


@pytest.mark.integration
def test_migrates_a_real_embedded_clickhouse_once(tmp_path):
    """The real engine (chdb), in its own process: a chdb path is open in one process at a time."""
    pytest.importorskip("chdb")
    dsn = f"chdb://{tmp_path / 'ch'}"
    command = [sys.executable, "-m", "runwatch.cli", "migrate", "--dsn", dsn, "--wait", "0"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert f"applied now: {[m.version for m in MIGRATIONS]}" in first.stdout
    second = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "applied now: none" in second.stdout


def test_the_sinks_retention_figures_are_the_tables_ttls():
    """The sink refuses rows its tables' TTL would delete at once (sinks/runwatch/sinks/rows.py
    RETENTION_DAYS): those figures must be the migrations' own."""
    import re

    from runwatch.sinks.rows import RETENTION_DAYS

    ttls = {}
    for migration in MIGRATIONS:
        for statement in migration.statements:
            table = re.search(r"CREATE TABLE IF NOT EXISTS \{db\}\.(\w+)", statement)
            ttl = re.search(r"TTL toDateTime\(ts\) \+ INTERVAL (\d+) DAY", statement)
            if table and ttl:
                ttls[table.group(1)] = int(ttl.group(1))
    assert ttls == RETENTION_DAYS
