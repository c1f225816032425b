"""One registry of detectors: everything that names detectors derives from it, a policy rule that
names an unknown detector is a config error, and a detector installed as a package of its own (its
entry point in the group ``runwatch.detectors``) shows up in the config model, the monitor and `replay`
with no other change, and passes the conformance suite; a plugin that cannot be loaded says which."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from runwatch.detectors import plugins, registry
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import DETECTORS, JOINED_VIEW, RANK_VIEW
from runwatch.detectors.engine.policy import EPISODIC_DETECTORS
from runwatch.detectors.offline.calibrate import SENSITIVITY_KNOBS

REPO = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).with_name("plugins")


def test_everything_that_names_detectors_derives_from_the_registry():
    names = registry.names()
    assert list(RunwatchConfig().detectors.model_dump()) == names
    assert set(DETECTORS) | set(registry.names("cross_rank")) == set(names)
    assert JOINED_VIEW == set(registry.names("joined")) and RANK_VIEW == set(registry.names("rank"))
    assert set(EPISODIC_DETECTORS) == {"stall", "hung_rank"}
    assert SENSITIVITY_KNOBS == {s.name: s.knob for s in registry.specs() if s.knob}
    for spec in registry.specs():  # each config section is defined beside its detector
        assert spec.config.__module__ == spec.build.__module__, spec.name
    # the scenario corpus labels each fault with the detector that declares it
    assert (
        registry.detector_for_fault()["memory_leak"]
        == registry.detector_for_fault()["memory_fragmentation"]
        == "memory_growth"
    )
    # (skipped_updates reads what the trainer's guard did: the corpus records faults unguarded;
    # replica_divergence compares replicas, which the corpus's single-rank runs do not have)
    assert set(registry.detector_for_fault().values()) == set(registry.names()) - set(
        registry.names("cross_rank")
    ) - {"skipped_updates", "replica_divergence"}


def test_the_documented_table_lists_every_detector():
    table = (REPO / "docs" / "detectors.md").read_text()
    first_cells = re.findall(r"^\| ((?:`[a-z_]+`(?:, )?)+) \|", table, flags=re.M)
    documented = {name for cell in first_cells for name in re.findall(r"`([a-z_]+)`", cell)}
    assert set(registry.names()) <= documented, set(registry.names()) - documented


def test_a_policy_rule_naming_an_unknown_detector_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown detector 'loss_spik'.*loss_spike.*not_recovered"):
        RunwatchConfig.model_validate({"policy": {"rules": [{"detector": "loss_spik", "action": "alert"}]}})
    RunwatchConfig.model_validate({"policy": {"rules": [{"detector": "not_recovered", "action": "stop"}]}})


TOY_PROBE = """
import json, sys
from datetime import UTC, datetime, timedelta
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import DETECTORS, RunMonitor
from runwatch.detectors.offline.replay import replay_file
from runwatch.contract.schema import StepEvent

config = RunwatchConfig.model_validate({
    "detectors": {"toy_loss_ceiling": {"ceiling": 5.0}},
    "policy": {"rules": [{"detector": "toy_loss_ceiling", "action": "alert"}]},
})
t0 = datetime(2026, 11, 23, tzinfo=UTC)
events = [
    StepEvent(run_id="toy", step=s, loss=9.0 if s == 7 else 1.0, ts=t0 + timedelta(seconds=s))
    for s in range(10)
]
monitor = RunMonitor("toy", config)
online = [a.detector for e in events for a in monitor.observe(e).anomalies]
path = sys.argv[1]
with open(path, "w") as f:
    f.writelines(e.to_json().decode() + "\\n" for e in events)
offline = [(a.detector, a.step) for a in replay_file(path, config).anomalies]
print(json.dumps({"config": config.detectors.toy_loss_ceiling.ceiling,
                  "wired": "toy_loss_ceiling" in DETECTORS, "online": online, "offline": offline}))
"""


def install_toy_plugin(into: Path) -> Path:
    """The toy detector (plugins/: its module and pyproject.toml) built and installed with pip, as a user
    installs a package, into ``into``/site: a folder for sys.path, holding the module and the
    distribution's .dist-info with its entry point. Built from a copy: pip builds in the source tree."""
    source = into / "toy-detector"
    source.mkdir(parents=True)
    for name in ("pyproject.toml", "toy_detector.py"):
        shutil.copy(PLUGINS / name, source / name)
    site = into / "site"
    # offline: the build backend is the environment's own setuptools, and runwatch is already there
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index"]
    done = subprocess.run(
        [*pip, "--no-deps", "--no-build-isolation", "--target", str(site), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return site


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_toy_plugin(tmp_path_factory.mktemp("toy-plugin"))


def on_path(*folders: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*map(str, folders), os.environ.get("PYTHONPATH", "")]),
    }


@pytest.mark.integration  # starts a process
def test_a_detector_installed_as_a_package_is_configured_wired_and_replayed(tmp_path, toy_site):
    out = subprocess.run(
        [sys.executable, "-c", TOY_PROBE, str(tmp_path / "toy.jsonl")],
        env=on_path(toy_site),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "config": 5.0,
        "wired": True,
        "online": ["toy_loss_ceiling"],
        "offline": [["toy_loss_ceiling", 7]],
    }
    # the same module importable but not installed (no entry point): unknown, a rule naming it refused
    plain = subprocess.run(
        [sys.executable, "-c", TOY_PROBE, str(tmp_path / "plain.jsonl")],
        env=on_path(PLUGINS),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode != 0 and "unknown detector 'toy_loss_ceiling'" in plain.stderr


@pytest.mark.integration  # starts a process
def test_the_installed_plugin_passes_the_conformance_suite(toy_site):
    """The conformance suite, run in a fresh interpreter that finds the plugin through its entry point:
    its parametrised checks gain the toy's cases, and they pass."""
    suite = Path(__file__).with_name("test_conformance.py")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            str(suite),
            "-k",
            "toy_loss_ceiling",
        ],
        env=on_path(toy_site),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    passed = set(re.findall(r"^PASSED \S+::(\w+)\[toy_loss_ceiling\]", out.stdout, flags=re.M))
    # every check the suite makes of each registered detector (the rollback replay is for the built-in
    # detectors of the faults its stream holds)
    assert passed == {
        "test_nothing_during_warm_up_and_the_same_input_gives_the_same_findings",
        "test_events_of_kinds_it_does_not_read_change_nothing",
        "test_state_pickles_mid_stream_and_resumes_with_the_same_findings",
    }, out.stdout[-3000:]
    assert "FAILED" not in out.stdout and "SKIPPED" not in out.stdout


# -- a plugin that cannot be loaded: the error names it, and nothing is registered ---------------------

IMPOSTOR = registry.DetectorSpec(
    name="loss_spike", config=registry.Strict, build=lambda d: None, view="rank", summary="an impostor"
)


def entry(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=plugins.GROUP)


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        (
            "broken",
            "no_such_plugin_module:SPEC",
            r"'broken'.*failed to load: ModuleNotFoundError.*no_such_plugin",
        ),
        ("loss_ceiling", f"{__name__}:IMPOSTOR", r"'loss_ceiling'.*names the detector 'loss_spike'"),
        ("loss_spike", f"{__name__}:IMPOSTOR", r"would replace the detector 'loss_spike'"),
        ("listed", f"{__name__}:REPO", r"is a PosixPath: it must name a DetectorSpec or a module"),
        ("nothing", "json", r"'nothing'.*registers no detector"),
    ],
)
def test_a_plugin_that_cannot_be_loaded_says_which_and_why(name, value, says):
    before = registry.registered()
    with pytest.raises(plugins.DetectorPluginError, match=says):
        plugins.load_entry(entry(name, value))
    assert registry.registered() == before


@pytest.mark.integration  # starts a process
def test_a_broken_installed_plugin_stops_a_command_with_one_line(tmp_path):
    """An installed distribution (its .dist-info as pip writes it, by hand: it needs no build) whose
    entry point's module is missing: `runwatch config` exits 2 with one line naming the plugin."""
    dist = tmp_path / "site" / "broken_detector-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-detector\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{plugins.GROUP}]\nbroken = no_such_plugin_module:SPEC\n")
    out = subprocess.run(
        [sys.executable, "-m", "runwatch.cli", "config", "--defaults"],
        env=on_path(tmp_path / "site"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: detector plugin 'broken' (runwatch.detectors entry point 'no_such_plugin_module:SPEC' of "
        "broken-detector 1.0) failed to load: ModuleNotFoundError: No module named 'no_such_plugin_module'"
    ]
