"""The YAML config: defaults need no file, one overridden field leaves the rest at their defaults,
and every bad file (typo'd key, inconsistent values, broken YAML, missing or unreadable file) is a
``ConfigError`` that says what is wrong instead of a traceback or a silent fallback."""

from __future__ import annotations

import pytest
import yaml

from runwatch.detectors.config import ConfigError, RunwatchConfig, defaults_yaml, load_config


def _write(tmp_path, text: str | bytes):
    path = tmp_path / "runwatch.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_defaults_without_a_file():
    cfg = load_config(None)
    assert cfg == RunwatchConfig()
    assert cfg.detectors.non_finite.max_consecutive == 3
    assert cfg.detectors.loss_spike.warmup <= cfg.detectors.loss_spike.window
    rules = [(r.detector, r.min_severity, r.action) for r in cfg.policy.rules]
    # a divergence (critical spike), a non-finite value and a failed recovery roll back; the rest alerts
    assert rules == [
        ("non_finite", "critical", "rollback"),
        ("skipped_updates", "critical", "rollback"),
        ("loss_spike", "critical", "rollback"),
        ("grad_norm_spike", "critical", "rollback"),
        ("not_recovered", "warning", "rollback"),
        ("*", "warning", "alert"),
    ]
    assert cfg.policy.action_ttl_s > 0


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(_write(tmp_path, "")) == RunwatchConfig()


def test_overriding_one_field_keeps_the_other_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, "detectors:\n  loss_spike:\n    z_threshold: 8.5\n"))
    assert cfg.detectors.loss_spike.z_threshold == 8.5
    defaults = RunwatchConfig()
    assert cfg.detectors.loss_spike.window == defaults.detectors.loss_spike.window
    assert cfg.detectors.grad_norm_spike == defaults.detectors.grad_norm_spike
    assert cfg.policy == defaults.policy


def test_policy_rules_from_yaml(tmp_path):
    text = """
policy:
  max_rollbacks: 1
  rules:
    - {detector: loss_spike, min_severity: critical, action: pause}
"""
    cfg = load_config(_write(tmp_path, text))
    assert cfg.policy.max_rollbacks == 1
    assert [(r.detector, r.action) for r in cfg.policy.rules] == [("loss_spike", "pause")]


def test_printed_defaults_load_back_identically(tmp_path):
    assert load_config(_write(tmp_path, defaults_yaml())) == RunwatchConfig()


@pytest.mark.parametrize(
    "text, key",
    [
        ("detectors:\n  loss_spike:\n    windw: 50\n", "windw"),
        ("polcy:\n  cooldown_s: 5\n", "polcy"),
        ("policy:\n  rules:\n    - {action: alert, severity: critical}\n", "severity"),
    ],
)
def test_unknown_key_is_an_error_naming_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert key in str(info.value)


def test_warmup_longer_than_window_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="warmup"):
        load_config(_write(tmp_path, "detectors:\n  grad_norm_spike:\n    window: 10\n    warmup: 11\n"))


def test_critical_z_below_threshold_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="critical_z"):
        load_config(_write(tmp_path, "detectors:\n  loss_spike:\n    z_threshold: 15\n"))


@pytest.mark.parametrize(
    "text",
    [
        "policy:\n  max_rollbacks: -1\n",
        "policy:\n  action_ttl_s: 0\n",
        "policy:\n  rules:\n    - {action: reboot}\n",
        "detectors:\n  non_finite:\n    max_consecutive: 0\n",
        "detectors:\n  loss_spike:\n    window: lots\n",
        "- just\n- a list\n",
    ],
)
def test_invalid_values_are_errors(tmp_path, text):
    with pytest.raises(ConfigError):
        load_config(_write(tmp_path, text))


def test_invalid_yaml_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "detectors: [unclosed\n  loss_spike: {\n"))


def test_missing_file_is_an_error(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(missing)


def test_directory_instead_of_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError):
        load_config(tmp_path)


def test_binary_file_is_a_config_error(tmp_path):
    # e.g. a checkpoint passed by mistake: must be a ConfigError, not a UnicodeDecodeError traceback
    with pytest.raises(ConfigError):
        load_config(_write(tmp_path, b"\x80\x02\xff\xfe binary \x00"))


def test_defaults_yaml_is_valid_yaml_with_every_section():
    data = yaml.safe_load(defaults_yaml())
    assert set(data) == {"detectors", "join", "runs", "policy", "limits", "baseline"}
    assert set(data["detectors"]) == {
        "non_finite",
        "skipped_updates",
        "optimizer_swap",
        "loss_spike",
        "grad_norm_spike",
        "module_grad_explosion",
        "update_ratio",
        "throughput_drift",
        "data_wait",
        "memory_growth",
        "category_divergence",
        "val_vs_train",
        "loss_rise",
        "stall",
        "straggler",
        "hung_rank",
        "baseline_trajectory",
        "frozen_modules",
        "activations",
        "param_norm_drift",
        "eval_category_divergence",
        "val_train_gap",
        "replica_divergence",
    }
