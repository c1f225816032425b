"""The generated Grafana dashboards: the committed JSON is what the code generates, it validates
against the dashboard schema published with grafana-foundation-sdk, every query is wired to the
ClickHouse plugin the way it reads queries, and the macro expansion writes what the plugin writes."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from runwatch.cli.main import main as cli
from runwatch.contract.action_kinds import ACTION_KINDS
from runwatch.sinks.grafana.dashboards import DATASOURCE_UID, PLUGIN_ID, all_dashboards
from runwatch.sinks.grafana.generate import stale_files
from runwatch.sinks.grafana.macros import MacroError, QueryContext, expand, sqlstring
from runwatch.sinks.grafana.panels import DASHBOARDS

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "deploy" / "grafana" / "dashboards"
SCHEMA = ROOT / "sinks" / "runwatch" / "sinks" / "grafana" / "schema" / "dashboard.jsonschema.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"


def _targets(board: dict) -> list[dict]:
    found = [t for p in board["panels"] for t in p.get("targets", [])]
    return found + [a["target"] for a in board["annotations"]["list"] if not a.get("builtIn")]


def test_the_committed_json_is_what_the_code_generates():
    fresh = all_dashboards()
    assert sorted(fresh) == sorted(p.name for p in COMMITTED.glob("*.json"))
    for name, text in fresh.items():
        assert (COMMITTED / name).read_text(encoding="utf-8") == text, (
            f"{name} is out of date: run `runwatch grafana generate`"
        )
    assert stale_files(COMMITTED) == []


def test_generate_writes_the_files_and_check_finds_a_changed_one(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["grafana", "generate", "--out", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(all_dashboards())
    assert runner.invoke(cli, ["grafana", "generate", "--out", str(tmp_path), "--check"]).exit_code == 0
    run = tmp_path / "runwatch-run.json"
    run.write_text(run.read_text().replace("Loss", "Lost"))
    result = runner.invoke(cli, ["grafana", "generate", "--out", str(tmp_path), "--check"])
    assert result.exit_code == 1 and "runwatch-run.json" in result.output


def test_every_dashboard_validates_against_the_sdk_schema():
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    for name, text in all_dashboards().items():
        errors = [
            f"{'/'.join(map(str, e.absolute_path))}: {e.message[:200]}"
            for e in validator.iter_errors(json.loads(text))
        ]
        assert errors == [], name


def test_five_dashboards_with_their_variables_and_panels():
    boards = {
        spec.uid: json.loads(text) for spec, text in zip(DASHBOARDS, all_dashboards().values(), strict=True)
    }
    assert list(boards) == [
        "runwatch-fleet",
        "runwatch-run",
        "runwatch-ranks",
        "runwatch-baselines",
        "runwatch-pipeline",
    ]
    names = {uid: [v["name"] for v in b["templating"].get("list", [])] for uid, b in boards.items()}
    assert names["runwatch-run"] == names["runwatch-ranks"] == ["baseline_key", "run", "rank"]
    assert names["runwatch-baselines"][:2] == ["baseline_key", "run"]
    assert [a["name"] for a in boards["runwatch-run"]["annotations"]["list"]] == [
        "Annotations & Alerts",
        "Anomalies",
        *(f"Actions: {kind}" for kind in ACTION_KINDS),
        "Rollbacks",
    ]
    assert "Commits" in [a["name"] for a in boards["runwatch-baselines"]["annotations"]["list"]]
    for uid, board in boards.items():
        panels = [p for p in board["panels"] if p["type"] != "row"]
        assert len({p["title"] for p in panels}) == len(panels), uid
        for panel in panels:
            assert panel["datasource"] == {"type": PLUGIN_ID, "uid": DATASOURCE_UID}
            assert panel["gridPos"]["w"] > 0 and panel["gridPos"]["h"] > 0


def test_every_query_is_a_clickhouse_sql_query_with_time_aliased_and_the_plugin_macros():
    for text in all_dashboards().values():
        board = json.loads(text)
        for target in _targets(board):
            assert target["editorType"] == "sql" and target["datasource"]["type"] == PLUGIN_ID
            sql = target["rawSql"]
            # time series: a time column named time, filtered by the range, ordered by it
            if target["format"] == 0:
                assert re.search(r"\bAS time\b", sql) and sql.rstrip().endswith("ORDER BY time"), sql
                assert "$__timeFilter(" in sql, sql
            assert "{db}" not in sql and "runwatch." in sql


def test_macros_expand_as_the_plugin_writes_them():
    ctx = QueryContext(
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        datetime(2026, 1, 2, 4, 4, 5, 250000, tzinfo=UTC),
        interval_s=30,
    )
    sql = (
        "SELECT $__timeInterval(ts) AS time FROM t WHERE $__timeFilter(ts) AND x = ${run:sqlstring} "
        "AND r IN (${rank:sqlstring}) AND k IN ($keys) AND $__timeFilter_ms(toDateTime64(ts, 3)) "
        "AND d < $__toTime AND n = $__interval_s"
    )
    out = expand(sql, ctx, {"run": "it's", "rank": ["0", "1"], "keys": ["a", "b"]})
    assert out == (
        "SELECT toStartOfInterval(toDateTime(ts), INTERVAL 30 second) AS time FROM t "
        "WHERE ts >= toDateTime(1767323045) AND ts <= toDateTime(1767326645) AND x = 'it''s' "
        "AND r IN ('0','1') AND k IN ('a','b') "
        "AND toDateTime64(ts, 3) >= fromUnixTimestamp64Milli(1767323045000) AND "
        "toDateTime64(ts, 3) <= fromUnixTimestamp64Milli(1767326645250) "
        "AND d < toDateTime(1767326645) AND n = 30"
    )
    assert sqlstring(["a'b", "c"]) == "'a''b','c'"
    with pytest.raises(MacroError):
        expand("SELECT $__unknownMacro(ts)", ctx)
    with pytest.raises(MacroError):
        expand("SELECT ${missing}", ctx)


def test_the_provisioning_files_point_at_the_dashboards_and_a_read_only_user():
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "clickhouse.yaml").read_text())
    (ds,) = datasources["datasources"]
    assert ds["type"] == PLUGIN_ID and ds["uid"] == DATASOURCE_UID
    assert ds["jsonData"]["username"] == "runwatch_reader" and ds["jsonData"]["defaultDatabase"] == "runwatch"
    assert ds["secureJsonData"]["password"].startswith("$")  # from Grafana's environment, never in the file
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "runwatch.yaml").read_text())
    (provider,) = providers["providers"]
    assert (
        provider["type"] == "file"
        and provider["folder"] == "runwatch"
        and provider["allowUiUpdates"] is False
    )
