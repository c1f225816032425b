"""One registry of detectors: everything that names detectors derives from it, a policy rule that
names an unknown detector is a config error, and a detector from a module of your own (named in
$RUNWATCH_DETECTOR_MODULES) shows up in the config model, the monitor and `replay` with no other
change."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runwatch.detectors import registry
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


@pytest.mark.integration  # starts a process
def test_a_detector_from_your_own_module_is_configured_wired_and_replayed(tmp_path):
    env = {
        **os.environ,
        "RUNWATCH_DETECTOR_MODULES": "toy_detector",
        "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", TOY_PROBE, str(tmp_path / "toy.jsonl")],
        env=env,
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
    # without the variable it is unknown: a rule naming it is refused
    plain = subprocess.run(
        [sys.executable, "-c", TOY_PROBE, str(tmp_path / "plain.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "RUNWATCH_DETECTOR_MODULES"},
    )
    assert plain.returncode != 0 and "unknown detector 'toy_loss_ceiling'" in plain.stderr
