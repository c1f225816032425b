"""Remediation core: templates are filled only from allowed, validated values (a value that could
change the command line is refused, and the command is not run), configs that could run something
unintended are rejected, only correctly signed and unexpired actions act, and each (action, target)
is performed once however often the action arrives."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.producer.schema import Action, CheckpointRef
from runwatch.producer.signing import sign_action
from runwatch.producer.topics import SECRET_ENV
from runwatch.sinks.remediate import (
    ConfigError,
    RefusedValue,
    RemediationConfig,
    Remediator,
    fill_argv,
    load_remediation_config,
    placeholder_values,
    run_command,
    slack_payload,
)

SECRET = b"remediate-secret"
NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _action(**overrides) -> Action:
    fields = dict(action_id="act-1", run_id="run-1", kind="stop", reason="loss <NaN> & grads", step=42,
                  target_checkpoint=CheckpointRef(step=40, uri="/ckpt/40.pt"),
                  issued_at=NOW, expires_at=NOW + timedelta(seconds=120))
    fields.update(overrides)
    return Action(**fields)


def _signed(**overrides) -> bytes:
    return sign_action(_action(**overrides), SECRET).to_json()


# -- filling templates ------------------------------------------------------------------------


def test_fill_replaces_placeholders_inside_literal_text():
    values = {"job_id": "1234", "run_id": "run-1", "pod": "trainer-0"}
    argv = fill_argv(["kubectl", "delete", "pod/{pod}", "--label=run={run_id}", "{{literal}}"], values)
    assert argv == ["kubectl", "delete", "pod/trainer-0", "--label=run=run-1", "{literal}"]


@pytest.mark.parametrize("value", [
    "1234; rm -rf /", "$(reboot)", "`id`", "a b", "a|b", "a&b", "x>y", "job\n2", "", "-rf", "--all",
    "../../etc/passwd", "a" * 201, "ünïcode", "*",
])
def test_unsafe_values_are_refused(value):
    with pytest.raises(RefusedValue) as info:
        fill_argv(["scancel", "{job_id}"], {"job_id": value})
    assert "{job_id}" in str(info.value)


def test_missing_value_is_refused():
    with pytest.raises(RefusedValue, match="unknown"):
        fill_argv(["scancel", "{job_id}"], {"job_id": None})


def test_placeholder_values_prefer_signed_params_then_run_start_fields_then_tags():
    action = _action(params={"job_id": "from-params"})
    meta = {"job_id": "from-run-start", "host": "node-7", "tags": {"pod": "trainer-0", "host": "tag-host"}}
    values = placeholder_values(action, meta, {"marker": "/tmp/x"})
    assert values["job_id"] == "from-params"
    assert values["host"] == "node-7"
    assert values["pod"] == "trainer-0"
    assert values["step"] == "42" and values["target_step"] == "40" and values["onset_step"] is None
    assert values["marker"] == "/tmp/x"
    assert placeholder_values(_action(params={"job_id": {"x": 1}}), {}, {})["job_id"] is None


# -- configuration ------------------------------------------------------------------------------


def test_config_file_loads(tmp_path):
    path = tmp_path / "remediation.yaml"
    path.write_text(
        "vars: {partition: gpu}\n"
        "rules:\n"
        "  - kinds: [stop]\n"
        "    commands:\n"
        "      - argv: [scancel, '--partition={partition}', '{job_id}']\n"
        "        timeout_s: 30\n"
        "webhooks:\n"
        "  - url: https://hooks.slack.com/services/T0/B0/XYZ\n"
        "    kinds: [alert, stop]\n")
    config = load_remediation_config(path)
    assert [c.argv for c in config.commands_for("stop")] == [["scancel", "--partition={partition}", "{job_id}"]]
    assert config.commands_for("alert") == []
    assert [h.redacted_url() for h in config.webhooks_for("alert")] == ["https://hooks.slack.com/…"]


@pytest.mark.parametrize("data, complaint", [
    ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["scancel", "{secret}"]}]}]}, "allowed placeholders"),
    ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["{job_id}"]}]}]}, "argv[0]"),
    ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["echo", "{job_id!r}"]}]}]}, "conversions"),
    ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["echo", "{job_id.__class__}"]}]}]}, "plain name"),
    ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["echo", "{job_id"]}]}]}, "argv"),
    ({"rules": [{"kinds": ["stop"], "commands": [{"argv": []}]}]}, "argv"),
    ({"rules": [{"kinds": ["explode"], "commands": [{"argv": ["true"]}]}]}, "kinds"),
    ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["true"], "shell": True}]}]}, "shell"),
    ({"webhooks": [{"url": "file:///etc/passwd"}]}, "http"),
    ({"vars": {"dir": "a b"}}, "vars.dir"),
    ({"vars": {"job_id": "x"}}, "vars.job_id"),
    ({"unknown": 1}, "unknown"),
])
def test_bad_configs_are_rejected(tmp_path, data, complaint):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_remediation_config(path)
    assert complaint in str(info.value)


# -- acting ---------------------------------------------------------------------------------------


class Calls:
    def __init__(self):
        self.commands: list[list[str]] = []
        self.posts: list[tuple[str, dict]] = []
        self.recorded: list = []

    def runner(self, argv, timeout_s):
        self.commands.append(argv)
        return "ok", 0, "done\n"

    def poster(self, url, payload, timeout_s):
        self.posts.append((url, payload))
        return "ok", 200, "ok"


def _remediator(calls: Calls, **kw) -> Remediator:
    config = RemediationConfig.model_validate({
        "rules": [
            {"kinds": ["stop", "rollback"], "commands": [{"argv": ["scancel", "{job_id}"]}]},
            {"kinds": ["stop"], "commands": [{"argv": ["scancel", "{job_id}"]},  # same template: once
                                             {"argv": ["kubectl", "delete", "pod", "{pod}"]}]},
        ],
        "webhooks": [{"url": "http://127.0.0.1:9/hook", "kinds": ["stop", "alert"]}],
    })
    return Remediator(config, SECRET, record=calls.recorded.append, runner=calls.runner, poster=calls.poster,
                      now=lambda: NOW + timedelta(seconds=1), **kw)


def test_an_action_delivered_twice_is_performed_once():
    calls = Calls()
    rem = _remediator(calls, lookup_run=lambda run: {"job_id": "777", "tags": {"pod": "trainer-0"}})
    raw = _signed()
    first = rem.handle(raw)
    assert rem.handle(raw) == []
    assert calls.commands == [["scancel", "777"], ["kubectl", "delete", "pod", "trainer-0"]]
    assert [e.status for e in first] == ["ok", "ok", "ok"]
    assert len(calls.posts) == 1 and len(calls.recorded) == 3
    assert rem.ignored["duplicate"] == 1


def test_a_restarted_remediator_skips_what_is_recorded():
    calls = Calls()
    rem = _remediator(calls, lookup_run=lambda run: {"job_id": "777", "pod": "p"})
    rem.handle(_signed())
    again = Calls()
    restarted = _remediator(again, done=rem.done, lookup_run=lambda run: {"job_id": "777", "pod": "p"})
    assert restarted.handle(_signed()) == []
    assert again.commands == [] and again.posts == []


def test_forged_expired_and_malformed_actions_do_nothing():
    calls = Calls()
    rem = _remediator(calls)
    forged = sign_action(_action(action_id="forged"), b"not-the-secret").to_json()
    tampered = _action().model_copy(update={"signature": sign_action(_action(), SECRET).signature,
                                            "kind": "rollback"}).to_json()
    expired = _signed(action_id="old", expires_at=NOW)
    for raw in (forged, tampered, expired, b"{not json"):
        assert rem.handle(raw) == []
    assert calls.commands == [] and calls.posts == [] and calls.recorded == []
    assert rem.ignored == {"bad_signature": 2, "expired": 1, "malformed": 1}


def test_an_unsafe_value_refuses_the_command_and_is_recorded():
    calls = Calls()
    rem = _remediator(calls, lookup_run=lambda run: {"job_id": "1; reboot"})
    executions = rem.handle(_signed())
    assert calls.commands == []  # neither scancel nor kubectl (no pod known) ran
    assert [(e.target, e.status) for e in executions] == [("command", "refused"), ("command", "refused"),
                                                          ("webhook", "ok")]
    assert "{job_id}" in executions[0].output and "{pod}" in executions[1].output
    fields = calls.posts[0][1]["attachments"][0]["fields"]
    assert any(f["title"] == "command" and "refused" in f["value"] for f in fields)


def test_slack_payload_escapes_and_carries_the_action():
    payload = slack_payload(_action())
    assert payload["text"].startswith("runwatch *stop* for run `run-1` at step 42: loss &lt;NaN&gt; &amp; grads")
    assert payload["runwatch"]["action_id"] == "act-1" and "signature" not in payload["runwatch"]
    assert {"title": "kind", "value": "stop", "short": True} in payload["attachments"][0]["fields"]


# -- running commands -------------------------------------------------------------------------------


def test_run_command_captures_exit_code_and_output_without_a_shell(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "must-not-leak")
    status, code, out = run_command(
        [sys.executable, "-c", "import os, sys; print(sys.argv[1], os.environ.get(sys.argv[2])); sys.exit(3)",
         "$(echo hi);", SECRET_ENV], 10)
    assert (status, code) == ("failed", 3)
    assert out.strip() == "$(echo hi); None"  # no shell expansion, no secret in the environment


def test_run_command_timeout_and_missing_program():
    status, _, out = run_command([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert status == "timeout" and "killed" in out
    status, code, out = run_command(["/nonexistent/runwatch-program"], 5)
    assert (status, code) == ("failed", None) and "could not start" in out


def test_readme_example_config_is_valid(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("**Remediation.**"):]
    example = section[section.index("```yaml\n") + 8:section.index("```\n", section.index("```yaml\n") + 8)]
    path = tmp_path / "remediation.yaml"
    path.write_text(example)
    config = load_remediation_config(path)
    assert [c.argv[0] for c in config.commands_for("stop")] == ["scancel", "kubectl"]
    assert len(config.webhooks_for("alert")) == 1
