"""Remediation configs: a valid file loads, and a config that could run something unintended
(unknown placeholders, a shell, a self-declared target with neither a verify command nor the
platform's mapping, a bad field pattern or targets file) is rejected with the reason; the example in
docs/remediation.md is valid."""

from __future__ import annotations

import pytest

from runwatch.detectors.configfile import ConfigError
from runwatch.sinks.remediate.config import load_remediation_config
from runwatch.sinks.remediate.templates import fill_argv

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
