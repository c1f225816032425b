"""The remediation config (``runwatch remediate --config``): rules (action kinds -> argv command
templates, each optionally behind a ``verify`` command), webhooks, fixed ``vars``, per-field
patterns (``fields``) and the platform's ``targets`` mapping (inline or ``targets_file``: its entries are
sinks/runwatch/sinks/remediate/targets.py's).

Loading refuses a config that could run something unintended: an unknown placeholder, a program
that is a placeholder, an unsafe ``vars`` value, or a command aimed at a target the trainer
declares itself (``{job_id}``, ``{host}``, ``{pod}``) with neither a ``verify`` command nor a
``targets`` mapping. See docs/remediation.md.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
from pydantic import Field, PrivateAttr, field_validator, model_validator

from runwatch.contract.action_kinds import ActionKind
from runwatch.detectors.configfile import Strict, load_yaml_model
from runwatch.sinks.remediate.targets import Target, TargetsFile
from runwatch.sinks.remediate.templates import (
    ALLOWED_FIELDS,
    DECLARED_FIELDS,
    DEFAULT_FIELD_RULES,
    FieldRule,
    argv_fields,
    check_argv_template,
    unsafe_var_reason,
)

log = logging.getLogger(__name__)


class VerifyCommand(Strict):
    """Run before a command that uses self-declared targets: it must exit 0 within ``timeout_s``
    and print the run id (and nothing else) on each non-empty line of its stdout."""

    argv: list[str] = Field(
        min_length=1, description="program and arguments; {placeholders} allowed after argv[0]"
    )
    timeout_s: float = Field(default=10.0, gt=0, le=300)

    @field_validator("argv")
    @classmethod
    def _check_argv(cls, argv: list[str]) -> list[str]:
        return check_argv_template(argv)


class CommandTemplate(Strict):
    argv: list[str] = Field(
        min_length=1, description="program and arguments; {placeholders} allowed after argv[0]"
    )
    timeout_s: float = Field(default=60.0, gt=0, le=3600)
    verify: VerifyCommand | None = Field(default=None, description="default: the rule's verify")

    @field_validator("argv")
    @classmethod
    def _check_argv(cls, argv: list[str]) -> list[str]:
        return check_argv_template(argv)

    def key(self) -> str:
        return "command:" + hashlib.sha1(orjson.dumps(self.argv)).hexdigest()[:16]

    def declared_fields(self) -> list[str]:
        """The self-declared fields (``RUN_FIELDS``) this command's argv uses."""
        return [name for name in argv_fields(self.argv) if name in DECLARED_FIELDS]


class Rule(Strict):
    kinds: list[ActionKind] = Field(min_length=1)
    commands: list[CommandTemplate] = Field(min_length=1)
    verify: VerifyCommand | None = Field(
        default=None, description="for its commands that have none of their own"
    )

    @model_validator(mode="after")
    def _inherit_verify(self) -> Rule:
        for command in self.commands:
            if command.verify is None and self.verify is not None:
                command.verify = self.verify
        return self


class Webhook(Strict):
    url: str
    kinds: list[ActionKind] | None = Field(default=None, description="default: every kind")
    timeout_s: float = Field(default=10.0, gt=0, le=300)

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{url!r} is not an http(s) URL")
        return url

    def key(self) -> str:
        return "webhook:" + hashlib.sha1(self.url.encode()).hexdigest()[:16]

    def redacted_url(self) -> str:
        """Scheme and host only: a chat webhook's path is its secret."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}/…" if parts.path.strip("/") or parts.query else self.url

    def wants(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds


def _check_placeholders(where: str, command: CommandTemplate, allowed: set[str]) -> None:
    """``command``'s argv and its verify's use ``allowed`` placeholders only."""
    templates = [("", command.argv)] + ([("verify ", command.verify.argv)] if command.verify else [])
    for what, argv in templates:
        for name in argv_fields(argv):
            if name not in allowed:
                raise ValueError(
                    f"{where}: {what}{{{name}}}: allowed placeholders are {', '.join(sorted(allowed))}"
                )


def _check_declared_targets(where: str, command: CommandTemplate, mapped: bool) -> None:
    """A command aimed at self-declared fields has a verify command that checks every one of them,
    or else the config has a platform mapping (``mapped``)."""
    declared = command.declared_fields()
    if command.verify is not None:
        missing = [n for n in declared if n not in argv_fields(command.verify.argv)]
        if missing:
            raise ValueError(
                f"{where}: its verify command {command.verify.argv} must use every self-declared "
                f"field the command uses, so that it checks that target: missing "
                f"{', '.join('{' + n + '}' for n in missing)}"
            )
    elif declared and not mapped:
        raise ValueError(
            f"{where} uses {', '.join('{' + n + '}' for n in declared)}, which the trainer declares "
            "itself (run_start), with neither a `verify` command (whose output must be the run id) "
            "nor a platform `targets`/`targets_file` mapping: any run could aim it at another "
            "team's job. Add one; see docs/remediation.md"
        )


def _open_targets_file(targets_file: str) -> TargetsFile:
    """The config's ``targets_file``, which must be an absolute path to a good targets file."""
    path = Path(targets_file)
    if not path.is_absolute():
        raise ValueError(f"targets_file {targets_file!r} must be an absolute path")
    try:
        return TargetsFile(path)
    except ValueError as exc:
        raise ValueError(f"targets_file: {exc}") from None


class RemediationConfig(Strict):
    vars: dict[str, str] = Field(default_factory=dict, description="fixed placeholder values")
    fields: dict[str, FieldRule] = Field(
        default_factory=dict, description="field -> full-match pattern, or {pattern, allow: [hazards]}"
    )
    targets: dict[str, Target] | None = Field(
        default=None, description="platform mapping: run id -> {job_id, host, pod}, overriding the run's own"
    )
    targets_file: str | None = Field(default=None, description="absolute path of a YAML file like `targets`")
    rules: list[Rule] = Field(default_factory=list)
    webhooks: list[Webhook] = Field(default_factory=list)

    _rules: dict[str, FieldRule] = PrivateAttr(default_factory=dict)
    _targets_file: TargetsFile | None = PrivateAttr(default=None)

    @field_validator("fields", mode="before")
    @classmethod
    def _pattern_shorthand(cls, fields: Any) -> Any:
        if isinstance(fields, dict):
            return {k: {"pattern": v} if isinstance(v, str) else v for k, v in fields.items()}
        return fields

    @model_validator(mode="after")
    def _check(self) -> RemediationConfig:
        self._check_vars()
        self._check_fields()
        self._rules = {**DEFAULT_FIELD_RULES, **self.fields}
        self._check_commands()
        self._check_targets()
        if self.targets_file is not None:
            self._targets_file = _open_targets_file(self.targets_file)
        return self

    def _check_vars(self) -> None:
        """Each ``vars`` name is a plain name that is not a field's, and each value is safe."""
        for name, value in self.vars.items():
            if not name.isidentifier() or name in ALLOWED_FIELDS:
                raise ValueError(f"vars.{name}: must be a plain name other than {', '.join(ALLOWED_FIELDS)}")
            reason = unsafe_var_reason(value)
            if reason:
                raise ValueError(f"vars.{name} = {value!r} {reason}")

    def _check_fields(self) -> None:
        """``fields`` has patterns for the allowed fields only."""
        for name in self.fields:
            if name not in ALLOWED_FIELDS:
                raise ValueError(
                    f"fields.{name}: patterns are for {', '.join(ALLOWED_FIELDS)} "
                    "(vars are checked as written)"
                )

    def _check_commands(self) -> None:
        """Every rule's commands: known placeholders, self-declared targets checked, and one
        ``verify`` per identical command."""
        allowed = set(ALLOWED_FIELDS) | set(self.vars)
        mapped = self.targets is not None or self.targets_file is not None
        by_key: dict[str, CommandTemplate] = {}
        for r, rule in enumerate(self.rules):
            for c, command in enumerate(rule.commands):
                where = f"rules.{r}.commands.{c} {command.argv}"
                _check_placeholders(where, command, allowed)
                _check_declared_targets(where, command, mapped)
                earlier = by_key.setdefault(command.key(), command)
                if earlier.verify != command.verify:
                    raise ValueError(f"{where} appears twice with different verify commands")

    def _check_targets(self) -> None:
        """The inline ``targets`` values pass their fields' rules."""
        for run_id, target in (self.targets or {}).items():
            for name, value in target.values().items():
                reason = None if value is None else self._rules[name].reason(value)
                if reason:
                    raise ValueError(f"targets.{run_id}.{name} = {value!r} {reason}")

    def field_rules(self) -> dict[str, FieldRule]:
        """Every field's rule: the defaults with the config's ``fields`` over them."""
        return self._rules or dict(DEFAULT_FIELD_RULES)

    @property
    def has_mapping(self) -> bool:
        return self.targets is not None or self.targets_file is not None

    def target_for(self, run_id: str) -> Target | None:
        """The platform's entry for ``run_id`` (the file's over the inline one), if any."""
        if self._targets_file is not None:
            entry = self._targets_file.get(run_id)
            if entry is not None:
                return entry
        return (self.targets or {}).get(run_id)

    def commands_for(self, kind: str) -> list[CommandTemplate]:
        """Every command of every rule matching ``kind``, an identical template once."""
        seen: dict[str, CommandTemplate] = {}
        for rule in self.rules:
            if kind in rule.kinds:
                for command in rule.commands:
                    seen.setdefault(command.key(), command)
        return list(seen.values())

    def webhooks_for(self, kind: str) -> list[Webhook]:
        seen: dict[str, Webhook] = {}
        for hook in self.webhooks:
            if hook.wants(kind):
                seen.setdefault(hook.key(), hook)
        return list(seen.values())


def load_remediation_config(path: str | Path) -> RemediationConfig:
    return load_yaml_model(path, RemediationConfig, "remediation config")
