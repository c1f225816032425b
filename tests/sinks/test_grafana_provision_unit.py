"""The pure parts of ``runwatch grafana provision``: datasource settings, comparisons, uid wiring."""

from __future__ import annotations

import pytest

from runwatch.sinks.grafana.provision import (
    DASHBOARDS_DIR,
    ClickHouseDatasource,
    ProvisionError,
    connect,
    dashboard_differences,
    datasource_differences,
    datasource_from_url,
    folder_uid,
    load_dashboards,
    wire_datasource,
)


@pytest.mark.parametrize(
    ("url", "protocol", "secure", "port"),
    [
        ("native://r@ch", "native", False, 9000),
        ("clickhouse://r@ch", "native", False, 9000),
        ("clickhouses://r@ch", "native", True, 9440),
        ("http://r@ch", "http", False, 8123),
        ("https://r@ch:9999", "http", True, 9999),
    ],
)
def test_datasource_url_gives_protocol_tls_and_default_port(url, protocol, secure, port):
    ds = datasource_from_url(url)
    assert (ds.protocol, ds.secure, ds.port, ds.host, ds.username) == (protocol, secure, port, "ch", "r")


def test_datasource_url_user_password_and_database_and_overrides():
    ds = datasource_from_url("native://reader:p%40ss@ch:9000/metrics", uid="x", password=None)
    assert (ds.username, ds.password, ds.database, ds.uid) == ("reader", "p@ss", "metrics", "x")
    assert datasource_from_url("native://ch").database == "runwatch"  # the sink's, as the dashboards' SQL


@pytest.mark.parametrize("url", ["ftp://ch", "ch:9000", "native://"])
def test_a_url_that_is_not_clickhouse_is_refused(url):
    with pytest.raises(ValueError, match="not a ClickHouse URL"):
        datasource_from_url(url)


def test_the_body_keeps_extra_jsondata_and_sends_the_password_only_as_secure_data():
    ds = ClickHouseDatasource(password="pw")
    body = ds.body({"jsonData": {"version": "4.1.0", "host": "old"}, "version": 3})
    assert body["jsonData"]["version"] == "4.1.0" and body["jsonData"]["host"] == "clickhouse"
    assert body["version"] == 3 and body["secureJsonData"] == {"password": "pw"}
    assert body["type"] == "grafana-clickhouse-datasource" and body["access"] == "proxy"
    assert "secureJsonData" not in ds.body(with_password=False)


def stored(ds: ClickHouseDatasource, password_set: bool) -> dict:
    return {
        "name": ds.name,
        "type": "grafana-clickhouse-datasource",
        "access": "proxy",
        "jsonData": {**ds.json_data(), "version": "4.1.0"},
        "secureJsonFields": {"password": password_set},
    }


def test_datasource_differences_compare_what_runwatch_sets_and_the_password_only_when_missing():
    ds = ClickHouseDatasource(password="pw")
    assert datasource_differences(stored(ds, True), ds) == []
    assert datasource_differences(stored(ds, False), ds) == ["password"]
    assert datasource_differences(stored(ds, True), ds, update_password=True) == ["password"]
    moved = stored(ds, True) | {"jsonData": {**ds.json_data(), "port": 9440}}
    assert datasource_differences(moved, ds) == ["jsonData.port"]
    assert datasource_differences(stored(ds, False), ClickHouseDatasource()) == []  # no password wanted


def test_dashboard_differences_ignore_grafanas_id_and_version():
    wanted = {"uid": "a", "title": "A", "panels": [1], "id": None}
    assert (
        dashboard_differences({"uid": "a", "title": "A", "panels": [1], "id": 7, "version": 4}, wanted) == []
    )
    assert dashboard_differences({"uid": "a", "title": "B", "panels": [], "id": 7}, wanted) == [
        "panels",
        "title",
    ]


def test_wiring_points_every_clickhouse_reference_at_the_uid_and_leaves_variables():
    model = {
        "panels": [
            {
                "datasource": {"type": "grafana-clickhouse-datasource", "uid": "runwatch-clickhouse"},
                "targets": [{"datasource": {"type": "grafana-clickhouse-datasource", "uid": "${ds}"}}],
            },
            {"datasource": {"type": "prometheus", "uid": "prom"}},
        ]
    }
    wired = wire_datasource(model, "ours")
    assert wired["panels"][0]["datasource"]["uid"] == "ours"
    assert wired["panels"][0]["targets"][0]["datasource"]["uid"] == "${ds}"
    assert wired["panels"][1]["datasource"]["uid"] == "prom"
    assert model["panels"][0]["datasource"]["uid"] == "runwatch-clickhouse"  # a copy


def test_folder_uid_from_title():
    assert folder_uid("runwatch") == "runwatch"
    assert folder_uid("ML Platform / runwatch") == "ml-platform-runwatch"


def test_the_committed_dashboards_load_with_uids():
    dashboards = load_dashboards()
    assert len(dashboards) == 5 and len({d["uid"] for d in dashboards}) == 5
    assert load_dashboards(DASHBOARDS_DIR) == dashboards


def test_an_empty_dashboards_directory_says_to_generate(tmp_path):
    with pytest.raises(ProvisionError, match="runwatch grafana generate"):
        load_dashboards(tmp_path)


def test_connect_needs_a_token_and_an_http_url():
    with pytest.raises(ProvisionError, match="no token"):
        connect("http://grafana:3000", None)
    with pytest.raises(ProvisionError, match="http"):
        connect("grafana:3000", "t")
    assert connect("http://admin:admin@grafana:3000", None) is not None  # basic auth in the URL


def test_a_dry_run_with_no_grafana_lists_what_it_would_send_and_never_the_password():
    import socket

    from click.testing import CliRunner

    from runwatch.cli.main import main

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    url = f"http://admin:s3cret@127.0.0.1:{port}"
    done = CliRunner().invoke(main, ["grafana", "provision", "--url", url, "--dry-run", "--timeout", "2"])
    assert done.exit_code == 0, done.output
    assert "s3cret" not in done.output and f"admin:***@127.0.0.1:{port}" in done.output
    plan = [line.split()[4:6] for line in done.output.splitlines() if line.startswith("would create or")]
    assert plan[:2] == [["folder", "runwatch"], ["datasource", "runwatch-clickhouse"]]
    assert [kind for kind, _ in plan[2:]] == ["dashboard"] * 5
    failed = CliRunner().invoke(main, ["grafana", "provision", "--url", url, "--timeout", "2"])
    assert failed.exit_code == 2 and "s3cret" not in failed.output  # not a dry run: it must reach Grafana
