"""The remediator: a command aimed at a target the run declared itself runs only after a verify
command (a real program here) shows the target is the run's, or when the platform's mapping names it;
only correctly signed and unexpired actions act; each (action, target) is performed once however often
the action arrives, also after a restart; what it posts to a chat is escaped."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import pytest

from runwatch.contract.signing import ActionSigningKey, sign_action
from runwatch.detectors.configfile import ConfigError
from runwatch.sinks.remediate.config import RemediationConfig, Target, load_remediation_config
from runwatch.sinks.remediate.notifications import slack_payload
from runwatch.sinks.remediate.remediator import Remediator
from runwatch.sinks.remediate.templates import placeholder_values
from tests.support.action_keys import PUBLIC, WORKERS
from tests.support.remediation_actions import NOW, make_action, make_signed

# -- a stand-in platform ---------------------------------------------------------------------------


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
            make_signed(params={"job_id": "777"}, issued_at=ahead, expires_at=ahead + timedelta(minutes=2))
        )
        == []
    )
    assert rem.ignored["future"] == 1 and calls.recorded == []
    [execution] = rem.handle(make_signed(params={"job_id": "777"}))  # a current one still runs
    assert execution.argv == ["scancel", "777"]


def test_a_job_verified_as_the_runs_is_cancelled(platform):
    calls, rem = _one_command(platform)
    platform.set(jobs={"777": "run-1"})
    [execution] = rem.handle(make_signed(params={"job_id": "777"}))
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
    [execution] = rem.handle(make_signed(params={"job_id": "777"}))
    assert calls.commands == []
    assert execution.status == "unverified" and execution.argv == ["scancel", "777"]
    assert why in execution.output and "verify `" in execution.output
    assert rem.handle(make_signed(params={"job_id": "777"})) == []  # recorded: never retried


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
    [named_like_it] = rem.handle(make_signed(run_id="4242", params={"job_id": "4242"}))
    assert named_like_it.status == "unverified" and "equals its own declared {job_id}" in named_like_it.output
    [other] = rem.handle(make_signed(action_id="act-2", params={"job_id": "4242"}))
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
    [execution] = rem.handle(make_signed(params={"job_id": "777", "host": "@/etc/passwd"}))
    assert execution.status == "refused" and "verify not run: {host}" in execution.output
    assert calls.commands == []


def test_the_platforms_mapping_overrides_what_the_run_declares():
    calls, rem = _one_command(targets={"run-1": {"job_id": 555}})
    [mapped] = rem.handle(make_signed(params={"job_id": "777"}))  # the run says 777; the platform says 555
    assert (mapped.status, calls.commands) == ("ok", [["scancel", "555"]])
    [unmapped] = rem.handle(make_signed(action_id="act-2", run_id="run-2", params={"job_id": "777"}))
    assert unmapped.status == "unverified" and "not in the targets mapping" in unmapped.output
    assert calls.commands == [["scancel", "555"]]
    values = placeholder_values(
        make_action(params={"job_id": "777", "pod": "p"}), {"host": "h"}, {}, Target(job_id="555")
    )
    assert (values["job_id"], values["host"], values["pod"]) == ("555", None, None)  # only from the mapping


def test_a_mapped_run_is_verified_too_when_the_command_has_verify(platform):
    calls, rem = _one_command(platform, targets={"run-1": {"job_id": "555"}})
    platform.set(jobs={"555": "other-team-run"})
    [execution] = rem.handle(make_signed(params={"job_id": "777"}))
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
    assert [e.status for e in rem.handle(make_signed())] == ["ok"] and calls.commands == [["scancel", "555"]]
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
    assert [e.status for e in rem.handle(make_signed())] == ["ok", "ok"]
    assert calls.commands == [["notify-oncall", "--run=run-1", "42"]] and len(calls.posts) == 1


def test_an_action_delivered_twice_is_performed_once(platform):
    calls = Calls()
    rem = _remediator(calls, platform, lookup_run=lambda run: {"job_id": "777", "tags": {"pod": "trainer-0"}})
    raw = make_signed()
    first = rem.handle(raw)
    assert rem.handle(raw) == []
    assert calls.commands == [["scancel", "777"], ["kubectl", "delete", "pod", "trainer-0"]]
    assert [e.status for e in first] == ["ok", "ok", "ok"]
    assert len(calls.posts) == 1 and len(calls.recorded) == 3
    assert rem.ignored["duplicate"] == 1


def test_a_restarted_remediator_skips_what_is_recorded(platform):
    calls = Calls()
    rem = _remediator(calls, platform, lookup_run=lambda run: {"job_id": "777", "pod": "p"})
    rem.handle(make_signed())
    again = Calls()
    restarted = _remediator(
        again, platform, done=rem.done, lookup_run=lambda run: {"job_id": "777", "pod": "p"}
    )
    assert restarted.handle(make_signed()) == []
    assert again.commands == [] and again.posts == []


def test_forged_expired_and_malformed_actions_do_nothing(platform):
    calls = Calls()
    rem = _remediator(calls, platform)
    forged = sign_action(make_action(action_id="forged"), ActionSigningKey.generate()).to_json()
    tampered = (
        make_action()
        .model_copy(update={"signature": sign_action(make_action(), WORKERS).signature, "kind": "rollback"})
        .to_json()
    )
    expired = make_signed(action_id="old", expires_at=NOW)
    for raw in (forged, tampered, expired, b"{not json"):
        assert rem.handle(raw) == []
    assert calls.commands == [] and calls.posts == [] and calls.recorded == []
    assert rem.ignored == {"bad_signature": 2, "expired": 1, "malformed": 1}


def test_an_unsafe_value_refuses_the_command_and_is_recorded(platform):
    calls = Calls()
    rem = _remediator(calls, platform, lookup_run=lambda run: {"job_id": "1; reboot"})
    executions = rem.handle(make_signed())
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
    payload = slack_payload(make_action())
    assert payload["text"].startswith(
        "runwatch *stop* for run `run-1` at step 42: loss &lt;NaN&gt; &amp; grads"
    )
    assert payload["runwatch"]["action_id"] == "act-1" and "signature" not in payload["runwatch"]
    assert {"title": "kind", "value": "stop", "short": True} in payload["attachments"][0]["fields"]


def test_slack_payload_escapes_the_run_id_in_its_text_and_attachment():
    payload = slack_payload(make_action(run_id="r\n*forged* <!channel>"))
    fields = {f["title"]: f["value"] for f in payload["attachments"][0]["fields"]}
    assert fields["run_id"] == "r\\n*forged* &lt;!channel&gt;"
    assert "\n" not in payload["text"] and "<!channel>" not in payload["text"]
