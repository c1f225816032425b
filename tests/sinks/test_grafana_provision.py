"""``runwatch grafana provision`` run as a command against a local stand-in for Grafana's HTTP API.

No Grafana server can be installed on these machines: the stand-in (tests/support/grafana_standin.py)
speaks the endpoints grafana-client calls, keeps Grafana-like state, checks the bearer token and records
every request. The command runs in a subprocess, as a user runs it, with the committed dashboards.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.grafana_standin import GrafanaStandIn

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
TOKEN = "admin-token"


@pytest.fixture
def grafana() -> Iterator[GrafanaStandIn]:
    with GrafanaStandIn(admin_token=TOKEN) as standin:
        yield standin


def provision(url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RUNWATCH_GRAFANA", "RUNWATCH_CLICKHOUSE_READER"))
    }
    return subprocess.run(
        [sys.executable, "-m", "runwatch.cli", "grafana", "provision", "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, **(env or {})},
        check=False,
    )


def outcome_lines(stdout: str) -> list[list[str]]:
    """(action, kind, uid) of each object line."""
    return [
        line.split()[:3]
        for line in stdout.splitlines()
        if line.split()[1:2] in (["folder"], ["datasource"], ["dashboard"])
    ]


def datasource_refs(node: object) -> set[str]:
    """The uids of every ClickHouse datasource reference in a dashboard model."""
    if isinstance(node, dict):
        own = (
            {node["uid"]} if node.get("type") == "grafana-clickhouse-datasource" and "uid" in node else set()
        )
        return own.union(*(datasource_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(datasource_refs(v) for v in node))
    return set()


def test_first_run_creates_everything_and_the_second_only_reads(grafana):
    assert len(DASHBOARDS) == 5, DASHBOARDS
    first = provision(
        grafana.url,
        "--token",
        TOKEN,
        "--datasource-password",
        "s3cret",
        "--datasource-url",
        "native://reader@clickhouse.internal:9000/runwatch",
    )
    assert first.returncode == 0, first.stderr
    lines = outcome_lines(first.stdout)
    assert [line[:2] for line in lines] == [["created", "folder"], ["created", "datasource"]] + [
        ["created", "dashboard"]
    ] * 5
    assert "7 created, 0 updated, 0 unchanged" in first.stdout

    state = grafana.state
    assert list(state.folders) == ["runwatch"] and state.folders["runwatch"]["title"] == "runwatch"
    ds = state.datasources["runwatch-clickhouse"]
    assert ds["type"] == "grafana-clickhouse-datasource" and ds["access"] == "proxy"
    assert ds["jsonData"] == {
        "host": "clickhouse.internal",
        "port": 9000,
        "protocol": "native",
        "secure": False,
        "username": "reader",
        "defaultDatabase": "runwatch",
        "tlsSkipVerify": False,
    }
    assert ds["secureJsonFields"] == {"password": True} and state.secure["runwatch-clickhouse"] == {
        "password": "s3cret"
    }
    assert "s3cret" not in json.dumps(ds)  # the password is only ever secure data
    wanted = {json.loads(p.read_text())["uid"] for p in DASHBOARDS}
    assert set(state.dashboards) == wanted
    for uid, entry in state.dashboards.items():
        assert entry["folderUid"] == "runwatch", uid
        assert entry["dashboard"]["version"] == 1
        assert datasource_refs(entry["dashboard"]) == {"runwatch-clickhouse"}, uid
    first_writes = [(r.method, r.path) for r in grafana.requests if r.is_write]
    assert (
        first_writes
        == [("POST", "/api/folders"), ("POST", "/api/datasources")] + [("POST", "/api/dashboards/db")] * 5
    )
    assert all(r.authorization == f"Bearer {TOKEN}" for r in grafana.requests)
    assert all(
        r.status != 404
        or r.method == "GET"
        and r.path.startswith(("/api/folders/", "/api/datasources/", "/api/dashboards/uid/"))
        for r in grafana.requests
    )  # nothing outside the endpoints it means to call

    before = json.dumps([state.folders, state.datasources, state.dashboards], sort_keys=True)
    seen = len(grafana.requests)
    second = provision(
        grafana.url,
        "--token",
        TOKEN,
        "--datasource-password",
        "s3cret",
        "--datasource-url",
        "native://reader@clickhouse.internal:9000/runwatch",
    )
    assert second.returncode == 0, second.stderr
    assert [line[0] for line in outcome_lines(second.stdout)] == ["unchanged"] * 7
    assert "0 created, 0 updated, 7 unchanged" in second.stdout
    again = grafana.requests[seen:]
    assert again and all(r.method == "GET" for r in again), [(r.method, r.path) for r in again if r.is_write]
    assert json.dumps([state.folders, state.datasources, state.dashboards], sort_keys=True) == before


def test_dry_run_reads_and_says_what_it_would_do(grafana):
    done = provision(grafana.url, "--token", TOKEN, "--dry-run", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["counts"] == {"would create": 7} and report["dry_run"] is True
    assert all(r.method == "GET" for r in grafana.requests)
    assert not grafana.state.folders and not grafana.state.datasources and not grafana.state.dashboards


def test_what_someone_changed_in_grafana_is_put_back_and_only_that(grafana):
    assert provision(grafana.url, "--token", TOKEN).returncode == 0
    run = grafana.state.dashboards["runwatch-run"]["dashboard"]
    run["panels"] = run["panels"][1:]  # someone deleted a panel in the UI
    run["version"] += 1
    ds = grafana.state.datasources["runwatch-clickhouse"]
    ds["jsonData"] = {
        **ds["jsonData"],
        "host": "elsewhere",
        "version": "4.10.1",
    }  # the UI adds the plugin version
    seen = len(grafana.requests)

    done = provision(grafana.url, "--token", TOKEN, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    changed = {(o["kind"], o["uid"]): (o["action"], o["changed"]) for o in report["objects"]}
    assert changed[("dashboard", "runwatch-run")] == ("updated", ["panels"])
    assert changed[("datasource", "runwatch-clickhouse")] == ("updated", ["jsonData.host"])
    assert report["counts"] == {"updated": 2, "unchanged": 5}
    writes = [(r.method, r.path) for r in grafana.requests[seen:] if r.is_write]
    assert writes == [("PUT", "/api/datasources/uid/runwatch-clickhouse"), ("POST", "/api/dashboards/db")]
    assert grafana.state.datasources["runwatch-clickhouse"]["jsonData"]["host"] == "clickhouse"
    assert grafana.state.datasources["runwatch-clickhouse"]["jsonData"]["version"] == "4.10.1"  # kept
    assert grafana.state.dashboards["runwatch-run"]["dashboard"]["version"] == 3
    assert provision(grafana.url, "--token", TOKEN).stdout.count("unchanged ") == 7


def test_the_token_can_come_from_the_environment(grafana):
    done = provision(grafana.url, env={"RUNWATCH_GRAFANA_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr
    assert len(grafana.state.dashboards) == 5


def test_a_wrong_token_exits_2_saying_so(grafana):
    done = provision(grafana.url, "--token", "not-the-token")
    assert done.returncode == 2
    assert "refused the token (401 Unauthorized)" in done.stderr and "RUNWATCH_GRAFANA_TOKEN" in done.stderr
    assert [(r.method, r.status) for r in grafana.requests] == [("GET", 401)]
    assert not grafana.state.folders


def test_no_token_at_all_exits_2_before_any_request(grafana):
    done = provision(grafana.url)
    assert done.returncode == 2 and "no token" in done.stderr
    assert grafana.requests == []


def test_a_token_without_permission_exits_2_saying_so(grafana):
    done = provision(grafana.url, "--token", grafana.viewer_token)
    assert done.returncode == 2
    assert "403 Forbidden" in done.stderr and "creating folder runwatch" in done.stderr


def test_an_unreachable_grafana_exits_2_saying_so():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = provision(f"http://127.0.0.1:{port}", "--token", TOKEN, "--timeout", "5")
    assert done.returncode == 2
    assert f"cannot reach Grafana at http://127.0.0.1:{port}" in done.stderr


def test_a_response_that_is_not_grafanas_exits_2_saying_so(grafana):
    grafana.garbage = True  # an HTML error page from a proxy, say
    done = provision(grafana.url, "--token", TOKEN)
    assert done.returncode == 2
    assert "bad response from Grafana" in done.stderr


def test_a_datasource_with_the_same_name_and_another_uid_is_not_overwritten(grafana):
    assert provision(grafana.url, "--token", TOKEN, "--datasource-uid", "theirs").returncode == 0
    done = provision(grafana.url, "--token", TOKEN)
    assert done.returncode == 2
    assert "already exists with uid 'theirs'" in done.stderr and "--datasource-uid theirs" in done.stderr
    assert set(grafana.state.datasources) == {"theirs"}
