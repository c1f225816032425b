"""Remediation templates: placeholders are filled only from allowed values that match their field's
pattern, and a value that could change the command line (a shell character, a path, a URL, an
`@`, a leading dash, a control character) is refused, whatever the config widens."""

from __future__ import annotations

import pytest

from runwatch.sinks.remediate.config import RemediationConfig
from runwatch.sinks.remediate.templates import (
    DEFAULT_FIELD_RULES,
    RefusedValue,
    fill_argv,
    placeholder_values,
)
from tests.support.remediation_actions import make_action

# -- filling templates ------------------------------------------------------------------------


def test_fill_replaces_placeholders_inside_literal_text():
    values = {"job_id": "1234", "run_id": "run-1", "pod": "trainer-0"}
    argv = fill_argv(["kubectl", "delete", "pod/{pod}", "--label=run={run_id}", "{{literal}}"], values)
    assert argv == ["kubectl", "delete", "pod/trainer-0", "--label=run=run-1", "{literal}"]


@pytest.mark.parametrize(
    "value",
    [
        "1234; rm -rf /",
        "$(reboot)",
        "`id`",
        "a b",
        "a|b",
        "a&b",
        "x>y",
        "job\n2",
        "",
        "-rf",
        "--all",
        "../../etc/passwd",
        "a" * 201,
        "ünïcode",
        "*",
    ],
)
def test_unsafe_values_are_refused(value):
    with pytest.raises(RefusedValue) as info:
        fill_argv(["scancel", "{job_id}"], {"job_id": value})
    assert "{job_id}" in str(info.value)


def test_missing_value_is_refused():
    with pytest.raises(RefusedValue, match="unknown"):
        fill_argv(["scancel", "{job_id}"], {"job_id": None})


def test_placeholder_values_prefer_signed_params_then_run_start_fields_then_tags():
    action = make_action(params={"job_id": "from-params"})
    meta = {"job_id": "from-run-start", "host": "node-7", "tags": {"pod": "trainer-0", "host": "tag-host"}}
    values = placeholder_values(action, meta, {"marker": "/tmp/x"})
    assert values["job_id"] == "from-params"
    assert values["host"] == "node-7"
    assert values["pod"] == "trainer-0"
    assert values["step"] == "42" and values["target_step"] == "40" and values["onset_step"] is None
    assert values["marker"] == "/tmp/x"
    assert placeholder_values(make_action(params={"job_id": {"x": 1}}), {}, {})["job_id"] is None


# -- field patterns ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("job_id", "1234"),
        ("job_id", "1234_7"),
        ("host", "node-7.cluster"),
        ("host", "GPU3"),
        ("pod", "trainer-0"),
        ("pod", "llama-7b.worker-3"),
        ("run_id", "run-1.a_b"),
        ("action_id", "stop-0a1b"),
        ("kind", "rollback"),
        ("step", "42"),
    ],
)
def test_default_patterns_accept_real_targets(field, value):
    assert DEFAULT_FIELD_RULES[field].reason(value) is None
    assert fill_argv(["cmd", f"--x={{{field}}}"], {field: value}) == ["cmd", f"--x={value}"]


ATTACKS = [
    ("@/etc/passwd", "'@'"),
    ("file:///x", "URL"),
    ("/etc/passwd", "absolute path"),
    ("http://x", "URL"),
    ("user@node", "'@'"),
    ("-rf", "'-'"),
    ("a..b", "'..'"),
    ("a b", "whitespace"),
    ("a\tb", "control"),
    ("a\nb", "control"),
    ("a\x00b", "control"),
    ("a\u200bb", "control"),
    ("", "empty"),
]


@pytest.mark.parametrize("field", ["job_id", "host", "pod"])
@pytest.mark.parametrize("value, reason", ATTACKS)
def test_paths_urls_at_signs_and_options_are_refused_for_targets(field, value, reason):
    with pytest.raises(RefusedValue) as info:
        fill_argv(["scancel", "{" + field + "}"], {field: value})
    assert f"{{{field}}}" in str(info.value) and reason in str(info.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("job_id", "12a"),
        ("job_id", "12_"),
        ("job_id", "a" * 201),
        ("host", "node_7"),
        ("host", ".node"),
        ("pod", "Trainer-0"),
        ("pod", "trainer-"),
        ("pod", "a" * 254),
        ("run_id", "run:1"),
        ("step", "1e3"),
    ],
)
def test_values_outside_a_fields_pattern_are_refused(field, value):
    with pytest.raises(RefusedValue, match="does not match the pattern|longer than"):
        fill_argv(["cmd", "{" + field + "}"], {field: value})


def _rules(fields: dict) -> dict:
    return RemediationConfig.model_validate({"fields": fields}).field_rules()


def test_a_configured_pattern_replaces_the_default_but_the_hazard_checks_stay():
    rules = _rules({"job_id": ".+"})
    assert fill_argv(["scancel", "{job_id}"], {"job_id": "job.abc"}, rules) == ["scancel", "job.abc"]
    for value in ("@/etc/passwd", "/etc/passwd", "file:///x", "-x", "a b", "a..b"):
        with pytest.raises(RefusedValue):
            fill_argv(["scancel", "{job_id}"], {"job_id": value}, rules)
    assert rules["host"].reason("node-7") is None and rules["host"].reason("a_b") is not None  # defaults kept


def test_allow_widens_only_the_named_hazards_and_the_pattern_must_match_too():
    rules = _rules(
        {
            "host": {"pattern": "^[a-z0-9.@-]+$", "allow": ["at_sign"]},
            "job_id": {"pattern": "^[0-9]+$", "allow": ["at_sign"]},
        }
    )
    assert rules["host"].reason("ops@node-7") is None
    assert "absolute path" in rules["host"].reason("/node")  # not allowed: still refused
    assert "'..'" in rules["host"].reason("a@b..c")
    assert "does not match" in rules["job_id"].reason("1@2")  # allowed hazard, but the pattern says no


def test_control_characters_are_refused_whatever_the_config_allows():
    rules = _rules(
        {
            "host": {
                "pattern": ".+",
                "allow": ["whitespace", "at_sign", "url", "absolute_path", "leading_dash", "dot_dot"],
            }
        }
    )
    assert rules["host"].reason("-a b@/c://..") is None
    assert "control" in rules["host"].reason("a\nb")
    assert "control" in rules["host"].reason("a\x1bb")
    assert "longer than" in rules["host"].reason("a" * 257)
