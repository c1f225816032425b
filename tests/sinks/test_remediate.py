"""Remediation core: templates are filled only from allowed values that match their field's pattern
(a value that could change the command line is refused, and the command is not run); a command
aimed at a target the run declared itself runs only after a verify command (a real program here)
shows the target is the run's, or when the platform's mapping names it; configs that could run
something unintended are rejected; only correctly signed and unexpired actions act; and each
(action, target) is performed once however often the action arrives."""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest

from runwatch.contract.schema import Action, CheckpointRef
from runwatch.contract.signing import ActionSigningKey, sign_action
from runwatch.contract.topics import LEGACY_SECRET_ENV, SIGNING_KEY_ENV
from runwatch.detectors.configfile import ConfigError
from runwatch.sinks.remediate.config import RemediationConfig, Target, load_remediation_config
from runwatch.sinks.remediate.notifications import slack_payload
from runwatch.sinks.remediate.remediator import Remediator
from runwatch.sinks.remediate.runner import run_command, run_verify, verify_problem
from runwatch.sinks.remediate.templates import (
    DEFAULT_FIELD_RULES,
    RefusedValue,
    fill_argv,
    placeholder_values,
)
from tests.support.action_keys import PUBLIC, WORKERS

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _action(**overrides) -> Action:
    fields = dict(
        action_id="act-1",
        run_id="run-1",
        kind="stop",
        reason="loss <NaN> & grads",
        step=42,
        target_checkpoint=CheckpointRef(step=40, uri="/ckpt/40.pt"),
        issued_at=NOW,
        expires_at=NOW + timedelta(seconds=120),
    )
    fields.update(overrides)
    return Action(**fields)


def _signed(**overrides) -> bytes:
    return sign_action(_action(**overrides), WORKERS).to_json()


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
        "        verify: {argv: [squeue, -h, -j, '{job_id}', -o, '%k'], timeout_s: 5}\n"
        "webhooks:\n"
        "  - url: https://hooks.slack.com/services/T0/B0/XYZ\n"
        "    kinds: [alert, stop]\n"
    )
    config = load_remediation_config(path)
    assert [c.argv for c in config.commands_for("stop")] == [
        ["scancel", "--partition={partition}", "{job_id}"]
    ]
    assert config.commands_for("stop")[0].verify.argv == ["squeue", "-h", "-j", "{job_id}", "-o", "%k"]
    assert config.commands_for("alert") == []
    assert [h.redacted_url() for h in config.webhooks_for("alert")] == ["https://hooks.slack.com/…"]


@pytest.mark.parametrize(
    "data, complaint",
    [
        (
            {"rules": [{"kinds": ["stop"], "commands": [{"argv": ["scancel", "{secret}"]}]}]},
            "allowed placeholders",
        ),
        ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["{job_id}"]}]}]}, "argv[0]"),
        ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["echo", "{job_id!r}"]}]}]}, "conversions"),
        (
            {"rules": [{"kinds": ["stop"], "commands": [{"argv": ["echo", "{job_id.__class__}"]}]}]},
            "plain name",
        ),
        ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["echo", "{job_id"]}]}]}, "argv"),
        ({"rules": [{"kinds": ["stop"], "commands": [{"argv": []}]}]}, "argv"),
        ({"rules": [{"kinds": ["explode"], "commands": [{"argv": ["true"]}]}]}, "kinds"),
        ({"rules": [{"kinds": ["stop"], "commands": [{"argv": ["true"], "shell": True}]}]}, "shell"),
        ({"webhooks": [{"url": "file:///etc/passwd"}]}, "http"),
        ({"vars": {"dir": "a b"}}, "vars.dir"),
        ({"vars": {"job_id": "x"}}, "vars.job_id"),
        ({"unknown": 1}, "unknown"),
        # Self-declared targets need a verify command or the platform's mapping.
        (
            {"rules": [{"kinds": ["stop"], "commands": [{"argv": ["scancel", "{job_id}"]}]}]},
            "neither a `verify`",
        ),
        (
            {
                "rules": [
                    {"kinds": ["stop"], "commands": [{"argv": ["ssh", "{host}", "pkill", "-f", "{run_id}"]}]}
                ]
            },
            "uses {host}",
        ),
        (
            {
                "rules": [
                    {
                        "kinds": ["stop"],
                        "commands": [
                            {
                                "argv": ["kubectl", "delete", "pod", "{pod}"],
                                "verify": {"argv": ["squeue", "-j", "{job_id}"]},
                            }
                        ],
                    }
                ]
            },
            "missing {pod}",
        ),
        (
            {
                "rules": [
                    {
                        "kinds": ["stop"],
                        "commands": [
                            {"argv": ["scancel", "{job_id}"], "verify": {"argv": ["squeue", "{secret}"]}}
                        ],
                    }
                ]
            },
            "allowed placeholders",
        ),
        (
            {
                "rules": [
                    {
                        "kinds": ["stop"],
                        "commands": [{"argv": ["scancel", "{job_id}"], "verify": {"argv": ["{job_id}"]}}],
                    }
                ]
            },
            "argv[0]",
        ),
        (
            {
                "rules": [
                    {
                        "kinds": ["stop"],
                        "commands": [
                            {
                                "argv": ["scancel", "{job_id}"],
                                "verify": {"argv": ["squeue", "{job_id}"], "timeout_s": 0},
                            }
                        ],
                    }
                ]
            },
            "timeout_s",
        ),
        (
            {
                "rules": [
                    {
                        "kinds": ["stop"],
                        "commands": [
                            {"argv": ["scancel", "{job_id}"], "verify": {"argv": ["a", "{job_id}"]}}
                        ],
                    },
                    {
                        "kinds": ["rollback"],
                        "commands": [
                            {"argv": ["scancel", "{job_id}"], "verify": {"argv": ["b", "{job_id}"]}}
                        ],
                    },
                ]
            },
            "different verify",
        ),
        # Field patterns and the platform's mapping.
        ({"fields": {"secret": "x"}}, "fields.secret"),
        ({"fields": {"job_id": "[0-9"}}, "not a valid regular expression"),
        ({"fields": {"job_id": {"pattern": ".+", "allow": ["semicolon"]}}}, "allow"),
        ({"targets": {"run-1": {"job_id": "@/etc/passwd"}}}, "targets.run-1.job_id"),
        ({"targets": {"run-1": {"job_id": "12", "partition": "gpu"}}}, "partition"),
        ({"targets_file": "targets.yaml"}, "absolute path"),
        ({"targets_file": "/nonexistent/runwatch-targets.yaml"}, "cannot read"),
    ],
)
def test_bad_configs_are_rejected(tmp_path, data, complaint):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_remediation_config(path)
    assert complaint in str(info.value)


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


# -- verifying targets ------------------------------------------------------------------------------


def test_verify_output_must_be_the_run_id_on_every_line():
    assert verify_problem("run-1", "ok", 0, "run-1\n", "") is None
    assert verify_problem("run-1", "ok", 0, "  run-1  \n\nrun-1\n", "") is None  # array tasks: one line each
    assert "not the run id" in verify_problem("run-1", "ok", 0, "run-12\n", "")
    assert "not the run id" in verify_problem("run", "ok", 0, "run:other-team\n", "")  # no substring match
    assert "not the run id" in verify_problem("run-1", "ok", 0, "run-1\nrun-2\n", "")
    assert "printed nothing" in verify_problem("run-1", "ok", 0, "\n", "")
    assert verify_problem("run-1", "failed", 1, "run-1\n", "Invalid job id") == "exited 1: Invalid job id"
    assert verify_problem("run-1", "timeout", -9, "run-1\n", "") == "timed out"


def test_run_verify_takes_only_stdout_as_the_answer():
    script = "import sys; print('run-1', file=sys.stderr); print('other-run')"
    status, code, out, err = run_verify([sys.executable, "-c", script], 10)
    assert (status, code, out.strip(), err.strip()) == ("ok", 0, "other-run", "run-1")
    started = time.monotonic()
    status, _, _, _ = run_verify([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert status == "timeout" and time.monotonic() - started < 10
    status, code, _, err = run_verify(["/nonexistent/runwatch-verify"], 5)
    assert (status, code) == ("failed", None) and "could not start" in err


# A stand-in for the scheduler and the cluster: `lookup.py TABLE KEY` prints what the platform set at
# launch for that job or pod (as `squeue -h -j ID -o %k` prints a job's comment), and exits 1 with
# an error on stderr for one it does not know. A value "__hang__" sleeps instead.
LOOKUP = (
    "import json, sys, time\n"
    "table = json.load(open(sys.argv[1]))\n"
    "if sys.argv[2] not in table:\n"
    "    sys.exit(print('Invalid job id specified: ' + sys.argv[2], file=sys.stderr) or 1)\n"
    "if table[sys.argv[2]] == '__hang__':\n"
    "    time.sleep(60)\n"
    "print(table[sys.argv[2]])\n"
)


class Platform:
    def __init__(self, root):
        self.script = root / "lookup.py"
        self.script.write_text(LOOKUP)
        self.jobs_file, self.pods_file = root / "jobs.json", root / "pods.json"
        self.set(jobs={}, pods={})

    def set(self, jobs: dict | None = None, pods: dict | None = None) -> None:
        if jobs is not None:
            self.jobs_file.write_text(json.dumps(jobs))
        if pods is not None:
            self.pods_file.write_text(json.dumps(pods))

    def verify(self, field: str, timeout_s: float = 10) -> dict:
        table = self.jobs_file if field == "job_id" else self.pods_file
        return {
            "argv": [sys.executable, str(self.script), str(table), "{" + field + "}"],
            "timeout_s": timeout_s,
        }


@pytest.fixture
def platform(tmp_path) -> Platform:
    return Platform(tmp_path)


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


def _remediator(calls: Calls, platform: Platform, **kw) -> Remediator:
    platform.set(jobs={"777": "run-1"}, pods={"trainer-0": "run-1", "p": "run-1"})
    config = RemediationConfig.model_validate(
        {
            "rules": [
                {
                    "kinds": ["stop", "rollback"],
                    "verify": platform.verify("job_id"),
                    "commands": [{"argv": ["scancel", "{job_id}"]}],
                },
                {
                    "kinds": ["stop"],
                    "commands": [
                        {
                            "argv": ["scancel", "{job_id}"],
                            "verify": platform.verify("job_id"),
                        },  # same template: once
                        {"argv": ["kubectl", "delete", "pod", "{pod}"], "verify": platform.verify("pod")},
                    ],
                },
            ],
            "webhooks": [{"url": "http://127.0.0.1:9/hook", "kinds": ["stop", "alert"]}],
        }
    )
    return Remediator(
        config,
        PUBLIC,
        record=calls.recorded.append,
        runner=calls.runner,
        poster=calls.poster,
        now=lambda: NOW + timedelta(seconds=1),
        **kw,
    )


def _one_command(platform: Platform | None = None, **config) -> tuple[Calls, Remediator]:
    """A remediator with one `scancel {job_id}` rule for stop (verified by ``platform`` if given)."""
    command = {"argv": ["scancel", "{job_id}"]}
    if platform is not None:
        command["verify"] = platform.verify("job_id", timeout_s=config.pop("verify_timeout_s", 10))
    config = RemediationConfig.model_validate(
        {"rules": [{"kinds": ["stop"], "commands": [command]}], **config}
    )
    calls = Calls()
    return calls, Remediator(
        config,
        PUBLIC,
        record=calls.recorded.append,
        runner=calls.runner,
        poster=calls.poster,
        now=lambda: NOW + timedelta(seconds=1),
    )


def test_a_signed_action_dated_an_hour_ahead_is_not_run(platform):
    """The remediator refuses a future-dated action as the trainer's listener does (one inbox)."""
    calls, rem = _one_command(platform)
    platform.set(jobs={"777": "run-1"})
    ahead = NOW + timedelta(hours=1)
    assert (
        rem.handle(
            _signed(params={"job_id": "777"}, issued_at=ahead, expires_at=ahead + timedelta(minutes=2))
        )
        == []
    )
    assert rem.ignored["future"] == 1 and calls.recorded == []
    [execution] = rem.handle(_signed(params={"job_id": "777"}))  # a current one still runs
    assert execution.argv == ["scancel", "777"]


def test_a_job_verified_as_the_runs_is_cancelled(platform):
    calls, rem = _one_command(platform)
    platform.set(jobs={"777": "run-1"})
    [execution] = rem.handle(_signed(params={"job_id": "777"}))
    assert (execution.status, calls.commands) == ("ok", [["scancel", "777"]])


@pytest.mark.parametrize(
    "jobs, why",
    [
        ({"777": "other-team-run"}, "printed 'other-team-run', not the run id 'run-1'"),  # someone else's job
        ({"777": "run-1-old"}, "not the run id"),
        ({"777": ""}, "printed nothing"),  # a job launched without the comment
        ({}, "exited 1: Invalid job id specified: 777"),  # no such job (or it finished)
        ({"777": "__hang__"}, "timed out after 0.5s"),
    ],
)
def test_a_job_not_shown_to_be_the_runs_is_not_cancelled(platform, jobs, why):
    calls, rem = _one_command(platform, verify_timeout_s=0.5)
    platform.set(jobs=jobs)
    [execution] = rem.handle(_signed(params={"job_id": "777"}))
    assert calls.commands == []
    assert execution.status == "unverified" and execution.argv == ["scancel", "777"]
    assert why in execution.output and "verify `" in execution.output
    assert rem.handle(_signed(params={"job_id": "777"})) == []  # recorded: never retried


def test_a_verify_command_that_echoes_its_target_cannot_verify_a_run_named_like_it():
    config = RemediationConfig.model_validate(
        {
            "rules": [
                {
                    "kinds": ["stop"],
                    "commands": [
                        {"argv": ["scancel", "{job_id}"], "verify": {"argv": ["/bin/echo", "{job_id}"]}}
                    ],
                }
            ]
        }
    )
    calls = Calls()
    rem = Remediator(
        config,
        PUBLIC,
        record=calls.recorded.append,
        runner=calls.runner,
        poster=calls.poster,
        now=lambda: NOW + timedelta(seconds=1),
    )
    [named_like_it] = rem.handle(_signed(run_id="4242", params={"job_id": "4242"}))
    assert named_like_it.status == "unverified" and "equals its own declared {job_id}" in named_like_it.output
    [other] = rem.handle(_signed(action_id="act-2", params={"job_id": "4242"}))
    assert other.status == "unverified" and "printed '4242', not the run id 'run-1'" in other.output
    assert calls.commands == []


def test_an_unsafe_value_in_the_verify_command_is_refused_before_anything_runs(platform):
    config = RemediationConfig.model_validate(
        {
            "rules": [
                {
                    "kinds": ["stop"],
                    "commands": [
                        {
                            "argv": ["scancel", "{job_id}"],
                            "verify": {
                                "argv": [
                                    sys.executable,
                                    str(platform.script),
                                    str(platform.jobs_file),
                                    "{job_id}",
                                    "{host}",
                                ]
                            },
                        },
                    ],
                }
            ]
        }
    )
    calls = Calls()
    rem = Remediator(
        config,
        PUBLIC,
        record=calls.recorded.append,
        runner=calls.runner,
        poster=calls.poster,
        now=lambda: NOW + timedelta(seconds=1),
    )
    [execution] = rem.handle(_signed(params={"job_id": "777", "host": "@/etc/passwd"}))
    assert execution.status == "refused" and "verify not run: {host}" in execution.output
    assert calls.commands == []


def test_the_platforms_mapping_overrides_what_the_run_declares():
    calls, rem = _one_command(targets={"run-1": {"job_id": 555}})
    [mapped] = rem.handle(_signed(params={"job_id": "777"}))  # the run says 777; the platform says 555
    assert (mapped.status, calls.commands) == ("ok", [["scancel", "555"]])
    [unmapped] = rem.handle(_signed(action_id="act-2", run_id="run-2", params={"job_id": "777"}))
    assert unmapped.status == "unverified" and "not in the targets mapping" in unmapped.output
    assert calls.commands == [["scancel", "555"]]
    values = placeholder_values(
        _action(params={"job_id": "777", "pod": "p"}), {"host": "h"}, {}, Target(job_id="555")
    )
    assert (values["job_id"], values["host"], values["pod"]) == ("555", None, None)  # only from the mapping


def test_a_mapped_run_is_verified_too_when_the_command_has_verify(platform):
    calls, rem = _one_command(platform, targets={"run-1": {"job_id": "555"}})
    platform.set(jobs={"555": "other-team-run"})
    [execution] = rem.handle(_signed(params={"job_id": "777"}))
    assert execution.status == "unverified" and calls.commands == []


def test_a_targets_file_is_read_at_load_and_again_when_it_changes(tmp_path):
    targets = tmp_path / "targets.yaml"
    targets.write_text("run-1: {job_id: 555}\n")
    config_path = tmp_path / "remediation.yaml"
    config_path.write_text(
        f"targets_file: {targets}\nrules:\n  - kinds: [stop]\n"
        "    commands: [{argv: [scancel, '{job_id}']}]\n"
    )
    config = load_remediation_config(config_path)
    assert config.target_for("run-1").job_id == "555" and config.target_for("run-2") is None
    # appended by a launcher
    targets.write_text("run-1: {job_id: 555}\nrun-2: {job_id: '556_3', pod: trainer-2}\n")
    assert config.target_for("run-2") == Target(job_id="556_3", pod="trainer-2")
    targets.write_text("run-1: {job_id: [half-written\n")
    assert config.target_for("run-2").job_id == "556_3"  # the last good contents stay
    targets.write_text("run-1: {job_id: 555, pod: '@x'}\n")  # read, but still checked when used
    calls = Calls()
    rem = Remediator(
        config,
        PUBLIC,
        record=calls.recorded.append,
        runner=calls.runner,
        poster=calls.poster,
        now=lambda: NOW + timedelta(seconds=1),
    )
    assert [e.status for e in rem.handle(_signed())] == ["ok"] and calls.commands == [["scancel", "555"]]
    targets.write_text("- not a mapping\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"targets_file: {targets}\n")
    with pytest.raises(ConfigError, match="targets"):
        load_remediation_config(bad)


def test_commands_without_self_declared_targets_and_webhooks_need_no_verify():
    calls, rem = Calls(), None
    config = RemediationConfig.model_validate(
        {
            "rules": [
                {"kinds": ["stop"], "commands": [{"argv": ["notify-oncall", "--run={run_id}", "{step}"]}]}
            ],
            "webhooks": [{"url": "http://127.0.0.1:9/hook"}],
        }
    )
    rem = Remediator(
        config,
        PUBLIC,
        record=calls.recorded.append,
        runner=calls.runner,
        poster=calls.poster,
        now=lambda: NOW + timedelta(seconds=1),
    )
    assert [e.status for e in rem.handle(_signed())] == ["ok", "ok"]
    assert calls.commands == [["notify-oncall", "--run=run-1", "42"]] and len(calls.posts) == 1


def test_an_action_delivered_twice_is_performed_once(platform):
    calls = Calls()
    rem = _remediator(calls, platform, lookup_run=lambda run: {"job_id": "777", "tags": {"pod": "trainer-0"}})
    raw = _signed()
    first = rem.handle(raw)
    assert rem.handle(raw) == []
    assert calls.commands == [["scancel", "777"], ["kubectl", "delete", "pod", "trainer-0"]]
    assert [e.status for e in first] == ["ok", "ok", "ok"]
    assert len(calls.posts) == 1 and len(calls.recorded) == 3
    assert rem.ignored["duplicate"] == 1


def test_a_restarted_remediator_skips_what_is_recorded(platform):
    calls = Calls()
    rem = _remediator(calls, platform, lookup_run=lambda run: {"job_id": "777", "pod": "p"})
    rem.handle(_signed())
    again = Calls()
    restarted = _remediator(
        again, platform, done=rem.done, lookup_run=lambda run: {"job_id": "777", "pod": "p"}
    )
    assert restarted.handle(_signed()) == []
    assert again.commands == [] and again.posts == []


def test_forged_expired_and_malformed_actions_do_nothing(platform):
    calls = Calls()
    rem = _remediator(calls, platform)
    forged = sign_action(_action(action_id="forged"), ActionSigningKey.generate()).to_json()
    tampered = (
        _action()
        .model_copy(update={"signature": sign_action(_action(), WORKERS).signature, "kind": "rollback"})
        .to_json()
    )
    expired = _signed(action_id="old", expires_at=NOW)
    for raw in (forged, tampered, expired, b"{not json"):
        assert rem.handle(raw) == []
    assert calls.commands == [] and calls.posts == [] and calls.recorded == []
    assert rem.ignored == {"bad_signature": 2, "expired": 1, "malformed": 1}


def test_an_unsafe_value_refuses_the_command_and_is_recorded(platform):
    calls = Calls()
    rem = _remediator(calls, platform, lookup_run=lambda run: {"job_id": "1; reboot"})
    executions = rem.handle(_signed())
    assert calls.commands == []  # neither scancel nor kubectl (no pod known) ran
    assert [(e.target, e.status) for e in executions] == [
        ("command", "refused"),
        ("command", "refused"),
        ("webhook", "ok"),
    ]
    assert "{job_id}" in executions[0].output and "{pod}" in executions[1].output
    fields = calls.posts[0][1]["attachments"][0]["fields"]
    assert any(f["title"] == "command" and "refused" in f["value"] for f in fields)


def test_slack_payload_escapes_and_carries_the_action():
    payload = slack_payload(_action())
    assert payload["text"].startswith(
        "runwatch *stop* for run `run-1` at step 42: loss &lt;NaN&gt; &amp; grads"
    )
    assert payload["runwatch"]["action_id"] == "act-1" and "signature" not in payload["runwatch"]
    assert {"title": "kind", "value": "stop", "short": True} in payload["attachments"][0]["fields"]


def test_slack_payload_escapes_the_run_id_in_its_text_and_attachment():
    payload = slack_payload(_action(run_id="r\n*forged* <!channel>"))
    fields = {f["title"]: f["value"] for f in payload["attachments"][0]["fields"]}
    assert fields["run_id"] == "r\\n*forged* &lt;!channel&gt;"
    assert "\n" not in payload["text"] and "<!channel>" not in payload["text"]


# -- running commands -------------------------------------------------------------------------------


def test_run_command_captures_exit_code_and_output_without_a_shell(monkeypatch):
    for name in (SIGNING_KEY_ENV, LEGACY_SECRET_ENV, "RUNWATCH_STATE_SECRET"):
        monkeypatch.setenv(name, "must-not-leak")
    status, code, out = run_command(
        [
            sys.executable,
            "-c",
            "import os, sys; print(sys.argv[1], [os.environ.get(n) for n in sys.argv[2:]]); sys.exit(3)",
            "$(echo hi);",
            SIGNING_KEY_ENV,
            LEGACY_SECRET_ENV,
            "RUNWATCH_STATE_SECRET",
        ],
        10,
    )
    assert (status, code) == ("failed", 3)
    assert out.strip() == "$(echo hi); [None, None, None]"  # no shell expansion, no key in the environment


def test_run_command_timeout_and_missing_program():
    status, _, out = run_command([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert status == "timeout" and "killed" in out
    status, code, out = run_command(["/nonexistent/runwatch-program"], 5)
    assert (status, code) == ("failed", None) and "could not start" in out


def test_documented_example_config_is_valid(tmp_path):
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "remediation.md").read_text()
    start = docs.index("```yaml\n") + 8
    path = tmp_path / "remediation.yaml"
    path.write_text(docs[start : docs.index("```\n", start)])
    config = load_remediation_config(path)
    assert [c.argv[0] for c in config.commands_for("stop")] == ["scancel", "kubectl"]
    assert [c.verify.argv[0] for c in config.commands_for("stop")] == ["squeue", "kubectl"]
    assert (
        config.commands_for("rollback")[0].verify.argv[-1] == "jsonpath={{.metadata.labels.runwatch/run-id}}"
    )
    assert (
        fill_argv(config.commands_for("rollback")[0].verify.argv, {"pod": "trainer-0"})[-1]
        == "jsonpath={.metadata.labels.runwatch/run-id}"
    )
    assert len(config.webhooks_for("alert")) == 1
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "docs/remediation.md" in readme[readme.index("**Remediation.**") :]
