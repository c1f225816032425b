"""``runwatch remediate``: run configured commands and post to webhooks for signed actions.

A separate consumer of ``runwatch.actions`` (group ``runwatch-remediate``). For every action
whose HMAC signature and expiry check out, it runs the command templates of the rules that
match the action's kind, as argument lists without a shell, and posts Slack-compatible JSON
to the webhooks that want that kind.

Values: a template's placeholders come only from an allow-list (``ACTION_FIELDS``,
``RUN_FIELDS`` and the config's own ``vars``). Every filled-in value must full-match its field's
pattern (``DEFAULT_FIELD_PATTERNS``, or the config's ``fields``) and must not be empty, too long,
or hold control characters; and unless the field's config names the hazard in ``allow``, it must
not start with ``-`` or ``/``, contain ``://``, ``@``, ``..`` or whitespace (``HAZARDS``). A value
that fails is ``refused``: the command is not run. The program (``argv[0]``) is never a
placeholder, and the action secret is removed from the commands' environment.

Targets: ``job_id``, ``host`` and ``pod`` are *self-declared*: they come from the trainer's own
``run_start`` (the worker copies them into the signed action's ``params``, so the signature
proves nothing about them). They are taken from the platform's ``targets`` mapping (inline or
``targets_file``) when it has the run, and then only from there; otherwise from the action's
``params``, else from the run's newest ``run_start`` in ClickHouse ``telemetry`` (field, then
tag). A command that uses a self-declared value runs only after its ``verify`` command (argv, no
shell, with a timeout, the same placeholders) exits 0 and prints the run id and nothing else on
each non-empty line of its stdout; otherwise it is recorded ``unverified`` and not run. A command
using them with neither ``verify`` nor a mapping is a config error. See docs/remediation.md.

Idempotency: every execution is a row in ClickHouse ``remediations``; on start the
(action, target) pairs already recorded are loaded, and a pair that is recorded (ok, failed,
refused, unverified or timed out) is never run again, whether the action arrives twice or the
remediator restarted. Kafka offsets are committed only after the rows are stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import string
import subprocess
import threading
import unicodedata
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    RootModel,
    field_validator,
    model_validator,
)

from runwatch.configfile import ConfigError as ConfigError  # re-exported: callers catch it from here
from runwatch.configfile import Strict, load_yaml_model
from runwatch.producer import topics
from runwatch.producer.schema import Action, ActionKind, SchemaError, decode_action, utc_now
from runwatch.producer.signing import verify_action
from runwatch.sinks.clickhouse import as_utc
from runwatch.sinks.loop import ConsumeLoop, make_consumer, retry_durably

log = logging.getLogger(__name__)

REMEDIATE_GROUP = topics.REMEDIATE_GROUP

ACTION_FIELDS = ("run_id", "action_id", "kind", "step", "onset_step", "target_step")
# Self-declared by the trainer (its run_start) unless the platform's targets mapping gives them.
RUN_FIELDS = ("job_id", "host", "pod")
ALLOWED_FIELDS = ACTION_FIELDS + RUN_FIELDS
OUTPUT_LIMIT = 4000  # characters of a command's output (its tail) or a webhook's response kept
MAX_VALUE_LENGTH = 256  # no filled-in value is longer, whatever its pattern says

STATUSES = ("ok", "failed", "refused", "unverified", "timeout")

# Full-match patterns per field (Python regexes, ASCII classes); the config's `fields` replace them.
DEFAULT_FIELD_PATTERNS: dict[str, str] = {
    "job_id": r"^[0-9]+(_[0-9]+)?$",  # a SLURM job id, optionally an array task (1234_7)
    "host": r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$",  # a host name (".." is a hazard below)
    "pod": r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$",  # a Kubernetes object name
    "run_id": r"^[A-Za-z0-9._-]{1,200}$",
    "action_id": r"^[A-Za-z0-9._-]{1,200}$",
    "kind": r"^[a-z]{1,32}$",
    "step": r"^[0-9]{1,19}$",
    "onset_step": r"^[0-9]{1,19}$",
    "target_step": r"^[0-9]{1,19}$",
}

Hazard = Literal["leading_dash", "absolute_path", "url", "at_sign", "dot_dot", "whitespace"]

# What turns an argument into something else: refused for every field unless its config's
# `allow` names the hazard (and its pattern matches the value too).
HAZARDS: dict[str, tuple[Callable[[str], bool], str]] = {
    "leading_dash": (lambda v: v.startswith("-"), "starts with '-' (would read as an option)"),
    "absolute_path": (lambda v: v.startswith("/"), "is an absolute path"),
    "url": (lambda v: "://" in v, "looks like a URL ('://')"),
    "at_sign": (lambda v: "@" in v, "contains '@' (an @file argument or user@host)"),
    "dot_dot": (lambda v: ".." in v, "contains '..'"),
    "whitespace": (lambda v: any(c.isspace() for c in v), "contains whitespace"),
}

# `vars` are the platform's own literals (it could as well write them into the template): a
# looser check, done once at config load.
SAFE_VAR = re.compile(r"[A-Za-z0-9._:/@][A-Za-z0-9._:/@-]{0,199}")


class RefusedValue(ValueError):
    """A placeholder whose value is missing or unsafe: the command is not run."""


def _has_control(value: str) -> bool:
    # Cc control, Cf format (zero-width, bidi), Cs/Co/Cn; line/paragraph separators too.
    return any(unicodedata.category(c)[0] == "C" or unicodedata.category(c) in ("Zl", "Zp") for c in value)


class FieldRule(BaseModel):
    """A field's full-match pattern and the hazards it may carry anyway."""

    model_config = ConfigDict(extra="forbid")

    pattern: str
    allow: list[Hazard] = Field(default_factory=list)
    _regex: re.Pattern[str] = PrivateAttr()

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern, re.ASCII)
        except re.error as exc:
            raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None
        return pattern

    def model_post_init(self, _context: Any) -> None:
        self._regex = re.compile(self.pattern, re.ASCII)

    def reason(self, value: str) -> str | None:
        """Why ``value`` may not go into a command line as this field, or ``None`` if it may."""
        if not value:
            return "is empty"
        if len(value) > MAX_VALUE_LENGTH:
            return f"is longer than {MAX_VALUE_LENGTH} characters"
        if _has_control(value):
            return "contains control characters"
        for name, (present, what) in HAZARDS.items():
            if name not in self.allow and present(value):
                return what
        if not self._regex.fullmatch(value):
            return f"does not match the pattern {self.pattern}"
        return None


DEFAULT_FIELD_RULES: dict[str, FieldRule] = {name: FieldRule(pattern=p) for name, p in DEFAULT_FIELD_PATTERNS.items()}


def unsafe_var_reason(value: str) -> str | None:
    """Why a config ``vars`` value may not go into a command line, or ``None`` if it may."""
    if not SAFE_VAR.fullmatch(value):
        if not value:
            return "is empty"
        if len(value) > 200:
            return "is longer than 200 characters"
        if value.startswith("-"):
            return "starts with '-' (would read as an option)"
        return "has characters outside [A-Za-z0-9._:/@-]"
    if ".." in value:
        return "contains '..'"
    return None


def template_fields(arg: str) -> list[str]:
    """Placeholder names in one argument template; raises ``ValueError`` on a malformed one.

    Only plain ``{name}`` is accepted: no format specs, conversions, indexing or attributes.
    ``{{`` and ``}}`` are literal braces."""
    names = []
    for _literal, name, spec, conversion in string.Formatter().parse(arg):
        if name is None:
            continue
        if spec or conversion:
            raise ValueError(f"placeholder {{{name}}} in {arg!r}: format specs and conversions are not allowed")
        if not name.isidentifier():
            raise ValueError(f"placeholder {{{name}}} in {arg!r} is not a plain name")
        names.append(name)
    return names


def argv_fields(argv: list[str]) -> list[str]:
    """Placeholder names used anywhere in ``argv``, each once, in order."""
    return list(dict.fromkeys(name for arg in argv[1:] for name in template_fields(arg)))


def fill_argv(argv: list[str], values: Mapping[str, str | None],
              rules: Mapping[str, FieldRule] | None = None) -> list[str]:
    """The argument list with placeholders replaced; raises ``RefusedValue`` if any value is
    missing or unsafe (checked per value against its field's rule, so literal text in the
    template may be anything). A placeholder without a rule is a config ``vars`` value, checked
    at load."""
    rules = DEFAULT_FIELD_RULES if rules is None else rules
    out = []
    for arg in argv:
        parts = []
        for literal, name, _spec, _conv in string.Formatter().parse(arg):
            parts.append(literal)
            if name is None:
                continue
            if name not in values:
                raise RefusedValue(f"{{{name}}} is not an allowed placeholder")
            value = values[name]
            if value is None:
                raise RefusedValue(f"{{{name}}} is unknown for this action")
            rule = rules.get(name)
            reason = rule.reason(value) if rule is not None else unsafe_var_reason(value)
            if reason:
                raise RefusedValue(f"{{{name}}} = {value[:60]!r} {reason}")
            parts.append(value)
        out.append("".join(parts))
    return out


# -- configuration -------------------------------------------------------------------------


def check_argv_template(argv: list[str]) -> list[str]:
    if not argv[0] or template_fields(argv[0]) or "{" in argv[0] or "}" in argv[0]:
        raise ValueError("argv[0] (the program) must be a literal, non-empty name or path")
    for arg in argv[1:]:
        template_fields(arg)  # raises on a malformed template
    return argv


class VerifyCommand(Strict):
    """Run before a command that uses self-declared targets: it must exit 0 within ``timeout_s``
    and print the run id (and nothing else) on each non-empty line of its stdout."""

    argv: list[str] = Field(min_length=1, description="program and arguments; {placeholders} allowed after argv[0]")
    timeout_s: float = Field(default=10.0, gt=0, le=300)

    @field_validator("argv")
    @classmethod
    def _check_argv(cls, argv: list[str]) -> list[str]:
        return check_argv_template(argv)


class CommandTemplate(Strict):
    argv: list[str] = Field(min_length=1, description="program and arguments; {placeholders} allowed after argv[0]")
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
        return [name for name in argv_fields(self.argv) if name in RUN_FIELDS]


class Rule(Strict):
    kinds: list[ActionKind] = Field(min_length=1)
    commands: list[CommandTemplate] = Field(min_length=1)
    verify: VerifyCommand | None = Field(default=None, description="for its commands that have none of their own")

    @model_validator(mode="after")
    def _inherit_verify(self) -> Rule:
        for command in self.commands:
            if command.verify is None and self.verify is not None:
                command.verify = self.verify
        return self


class Target(Strict):
    """Where a run really runs, as the platform knows it."""

    job_id: str | None = None
    host: str | None = None
    pod: str | None = None

    @field_validator("job_id", "host", "pod", mode="before")
    @classmethod
    def _number_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    def values(self) -> dict[str, str | None]:
        return {name: getattr(self, name) for name in RUN_FIELDS}


class TargetsMapping(RootModel[dict[str, Target]]):
    """A targets file: a YAML mapping of run id -> {job_id, host, pod}."""


def read_targets_file(path: Path) -> dict[str, Target]:
    """The targets file's entries; raises ``ConfigError`` (a ``ValueError``) saying what is wrong."""
    return load_yaml_model(path, TargetsMapping, "targets file").root


class TargetsFile:
    """The platform's mapping file, re-read when its modification time or size changes; if a
    re-read fails (a half-written file), the last good contents stay in use."""

    def __init__(self, path: Path):
        self.path = path
        self.entries = read_targets_file(path)  # raises: a config pointing at a bad file is refused
        self._stamp = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def get(self, run_id: str) -> Target | None:
        stamp = self._stat()
        if stamp != self._stamp:
            self._stamp = stamp
            try:
                self.entries = read_targets_file(self.path)
            except ValueError as exc:
                log.warning("remediate: targets file re-read failed (%s); keeping its last good contents", exc)
        return self.entries.get(run_id)


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


class RemediationConfig(Strict):
    vars: dict[str, str] = Field(default_factory=dict, description="fixed placeholder values")
    fields: dict[str, FieldRule] = Field(
        default_factory=dict, description="field -> full-match pattern, or {pattern, allow: [hazards]}")
    targets: dict[str, Target] | None = Field(
        default=None, description="platform mapping: run id -> {job_id, host, pod}, overriding the run's own")
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
        for name, value in self.vars.items():
            if not name.isidentifier() or name in ALLOWED_FIELDS:
                raise ValueError(f"vars.{name}: must be a plain name other than {', '.join(ALLOWED_FIELDS)}")
            reason = unsafe_var_reason(value)
            if reason:
                raise ValueError(f"vars.{name} = {value!r} {reason}")
        for name in self.fields:
            if name not in ALLOWED_FIELDS:
                raise ValueError(f"fields.{name}: patterns are for {', '.join(ALLOWED_FIELDS)} "
                                 "(vars are checked as written)")
        self._rules = {**DEFAULT_FIELD_RULES, **self.fields}

        allowed = set(ALLOWED_FIELDS) | set(self.vars)
        mapped = self.targets is not None or self.targets_file is not None
        by_key: dict[str, CommandTemplate] = {}
        for r, rule in enumerate(self.rules):
            for c, command in enumerate(rule.commands):
                where = f"rules.{r}.commands.{c} {command.argv}"
                templates = [("", command.argv)] + ([("verify ", command.verify.argv)] if command.verify else [])
                for what, argv in templates:
                    for name in argv_fields(argv):
                        if name not in allowed:
                            raise ValueError(f"{where}: {what}{{{name}}}: allowed placeholders are "
                                             f"{', '.join(sorted(allowed))}")
                declared = command.declared_fields()
                if command.verify is not None:
                    missing = [n for n in declared if n not in argv_fields(command.verify.argv)]
                    if missing:
                        raise ValueError(
                            f"{where}: its verify command {command.verify.argv} must use every self-declared "
                            f"field the command uses, so that it checks that target: missing "
                            f"{', '.join('{' + n + '}' for n in missing)}")
                elif declared and not mapped:
                    raise ValueError(
                        f"{where} uses {', '.join('{' + n + '}' for n in declared)}, which the trainer declares "
                        "itself (run_start), with neither a `verify` command (whose output must be the run id) "
                        "nor a platform `targets`/`targets_file` mapping: any run could aim it at another "
                        "team's job. Add one; see docs/remediation.md")
                earlier = by_key.setdefault(command.key(), command)
                if earlier.verify != command.verify:
                    raise ValueError(f"{where} appears twice with different verify commands")

        for run_id, target in (self.targets or {}).items():
            for name, value in target.values().items():
                reason = None if value is None else self._rules[name].reason(value)
                if reason:
                    raise ValueError(f"targets.{run_id}.{name} = {value!r} {reason}")
        if self.targets_file is not None:
            path = Path(self.targets_file)
            if not path.is_absolute():
                raise ValueError(f"targets_file {self.targets_file!r} must be an absolute path")
            try:
                self._targets_file = TargetsFile(path)
            except ValueError as exc:
                raise ValueError(f"targets_file: {exc}") from None
        return self

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


# -- values, payloads, executions ------------------------------------------------------------


def placeholder_values(action: Action, run_meta: Mapping[str, Any], fixed: Mapping[str, str],
                       target: Target | None = None) -> dict[str, str | None]:
    """Every allowed placeholder's value for ``action`` (``None`` where unknown). With the
    platform's ``target`` for the run, ``job_id``/``host``/``pod`` come only from it; without, from
    the run's own declarations: the action's ``params``, else ``run_meta`` (run_start field, then tag)."""
    checkpoint = action.target_checkpoint
    values: dict[str, str | None] = {
        "run_id": action.run_id,
        "action_id": action.action_id,
        "kind": action.kind,
        "step": None if action.step is None else str(action.step),
        "onset_step": None if action.onset_step is None else str(action.onset_step),
        "target_step": None if checkpoint is None else str(checkpoint.step),
    }
    if target is not None:
        values.update(target.values())
    else:
        tags = run_meta.get("tags") if isinstance(run_meta.get("tags"), dict) else {}
        for name in RUN_FIELDS:
            value = action.params.get(name)
            if value is None:
                value = run_meta.get(name)
            if value is None:
                value = tags.get(name)
            # Only scalars become text; anything else is refused as unknown.
            values[name] = str(value) if isinstance(value, str | int) and not isinstance(value, bool) else None
    values.update(fixed)
    return values


def _slack_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


COLORS = {"alert": "warning", "pause": "warning", "resume": "good", "rollback": "danger", "stop": "danger"}


def slack_payload(action: Action, commands: Iterable[Execution] = ()) -> dict[str, Any]:
    """Slack-compatible JSON: ``text`` and an attachment with fields, plus the action itself
    (without its signature) under ``runwatch`` for machines."""
    step = f" at step {action.step}" if action.step is not None else ""
    text = f"runwatch *{action.kind}* for run `{_slack_escape(action.run_id)}`{step}: {_slack_escape(action.reason)}"
    fields = [
        {"title": "run_id", "value": action.run_id, "short": True},
        {"title": "kind", "value": action.kind, "short": True},
        {"title": "action_id", "value": action.action_id, "short": True},
    ]
    if action.step is not None:
        fields.append({"title": "step", "value": str(action.step), "short": True})
    if action.target_checkpoint is not None:
        fields.append({"title": "target checkpoint", "value": f"step {action.target_checkpoint.step}",
                       "short": True})
    for ex in commands:
        fields.append({"title": "command", "value": f"`{_slack_escape(' '.join(ex.argv))}`: {ex.status}"
                       + ("" if ex.exit_code is None else f" (exit {ex.exit_code})"), "short": False})
    body = orjson.loads(action.model_dump_json(exclude={"signature"}, exclude_none=True))
    return {
        "text": text,
        "attachments": [{"color": COLORS.get(action.kind, "warning"), "fallback": text, "fields": fields}],
        "runwatch": body,
    }


@dataclass
class Execution:
    """One command run or webhook post, as recorded in ClickHouse ``remediations``."""

    action_id: str
    run_id: str
    kind: str
    target: str  # command | webhook
    target_key: str
    status: str  # ok | failed | refused | unverified | timeout
    argv: list[str] = field(default_factory=list)
    url: str = ""
    exit_code: int | None = None  # a command's exit status; a webhook's HTTP status
    output: str = ""
    started_at: datetime = field(default_factory=utc_now)
    finished_at: datetime = field(default_factory=utc_now)
    execution_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def row(self) -> tuple:
        return (self.execution_id, self.action_id, self.run_id, self.kind, self.target, self.target_key,
                self.argv, self.url, self.status, self.exit_code, self.output, self.started_at, self.finished_at)


REMEDIATION_COLUMNS = (
    "execution_id", "action_id", "run_id", "kind", "target", "target_key", "argv", "url", "status",
    "exit_code", "output", "started_at", "finished_at",
)


def _tail(text: str) -> str:
    return text if len(text) <= OUTPUT_LIMIT else "…" + text[-OUTPUT_LIMIT:]


def child_env() -> dict[str, str]:
    """The remediator's environment without the action secret."""
    return {k: v for k, v in os.environ.items() if k != topics.SECRET_ENV}


def _spawn(argv: list[str], timeout_s: float, *, merge_stderr: bool) -> tuple[str, int | None, bytes, bytes]:
    """Run ``argv`` without a shell, its own session, stdin closed; returns (status, exit code,
    stdout, stderr). Status is ok, failed (non-zero exit or could not start: then stderr says
    why) or timeout (the whole process group killed)."""
    try:
        proc = subprocess.Popen(argv, shell=False, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, env=child_env(),
                                start_new_session=True)
    except OSError as exc:
        return "failed", None, b"", f"could not start {argv[0]!r}: {exc.strerror or exc}".encode()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Its own session: kill the whole group, so a grandchild holding the pipe cannot hang us.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = b"", b""
        return "timeout", proc.returncode, out or b"", err or b""
    return ("ok" if proc.returncode == 0 else "failed"), proc.returncode, out or b"", err or b""


def run_command(argv: list[str], timeout_s: float) -> tuple[str, int | None, str]:
    """Run ``argv`` without a shell; returns (status, exit code, output tail)."""
    status, code, out, err = _spawn(argv, timeout_s, merge_stderr=True)
    if code is None and status == "failed":
        return status, code, err.decode(errors="replace")
    text = _tail(out.decode(errors="replace"))
    return status, code, text + (f"\n[killed after {timeout_s}s]" if status == "timeout" else "")


def run_verify(argv: list[str], timeout_s: float) -> tuple[str, int | None, str, str]:
    """Run a verify command without a shell; returns (status, exit code, stdout, stderr tail).
    Only stdout counts as its answer: an error message on stderr that echoes the target can
    never verify it."""
    status, code, out, err = _spawn(argv, timeout_s, merge_stderr=False)
    return status, code, out.decode(errors="replace"), _tail(err.decode(errors="replace"))


def verify_problem(run_id: str, status: str, code: int | None, stdout: str, stderr: str) -> str | None:
    """Why a verify command's result does not show that the target belongs to ``run_id``, or
    ``None`` if it does: it exited 0 and every non-empty line of its stdout, stripped, is the run id
    (at least one line). A substring would not do: run "x" must not match a comment "x-team:run-9"."""
    if status == "timeout":
        return "timed out"
    if status != "ok":
        detail = stderr.strip()[-300:]
        return (f"exited {code}" if code is not None else "did not start") + (f": {detail}" if detail else "")
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return f"printed nothing; expected the run id {run_id!r}"
    for line in lines:
        if line != run_id:
            return f"printed {line[:120]!r}, not the run id {run_id!r}: the target is not this run's"
    return None


def post_webhook(url: str, payload: dict[str, Any], timeout_s: float) -> tuple[str, int | None, str]:
    """POST ``payload`` as JSON; returns (status, HTTP status, response body tail)."""
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "runwatch"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (http(s) checked)
            body = response.read(OUTPUT_LIMIT).decode(errors="replace")
            return ("ok" if 200 <= response.status < 300 else "failed"), response.status, body
    except urllib.error.HTTPError as exc:
        return "failed", exc.code, _tail(exc.read(OUTPUT_LIMIT).decode(errors="replace"))
    except TimeoutError:
        return "timeout", None, f"no answer within {timeout_s}s"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return ("timeout" if isinstance(reason, TimeoutError) else "failed"), None, str(reason)[:OUTPUT_LIMIT]


# -- the core ------------------------------------------------------------------------------------


class Remediator:
    """Decides and performs what one delivered action needs; I/O is injected.

    ``record`` stores one execution (and must not return before it is stored);
    ``lookup_run`` gives a run's ``run_start`` fields; ``done`` is what is already recorded,
    as (action_id, target_key) pairs; ``runner`` runs a command, ``verifier`` a verify command."""

    def __init__(
        self,
        config: RemediationConfig,
        secret: bytes,
        *,
        record: Callable[[Execution], None] = lambda _e: None,
        lookup_run: Callable[[str], Mapping[str, Any]] = lambda _run: {},
        done: Iterable[tuple[str, str]] = (),
        runner: Callable[[list[str], float], tuple[str, int | None, str]] = run_command,
        poster: Callable[[str, dict[str, Any], float], tuple[str, int | None, str]] = post_webhook,
        verifier: Callable[[list[str], float], tuple[str, int | None, str, str]] = run_verify,
        now: Callable[[], datetime] = utc_now,
    ):
        self.config = config
        self._secret = secret
        self._record = record
        self._lookup_run = lookup_run
        self._runner = runner
        self._verifier = verifier
        self._poster = poster
        self._now = now
        self.done: set[tuple[str, str]] = set(done)
        self.ignored: Counter[str] = Counter()
        self.executed: Counter[str] = Counter()  # by status

    def handle(self, raw: bytes) -> list[Execution]:
        """Everything done for one message from the action topic."""
        try:
            action = decode_action(raw)
        except SchemaError as exc:
            self.ignored["malformed"] += 1
            log.warning("remediate: malformed action ignored (%s)", exc.reason)
            return []
        if not verify_action(action, self._secret):
            self.ignored["bad_signature"] += 1
            log.warning("remediate: action %s for run %s has a bad signature; ignored",
                        action.action_id, action.run_id)
            return []
        if action.is_expired(self._now()):
            self.ignored["expired"] += 1
            log.info("remediate: action %s expired at %s; ignored", action.action_id, action.expires_at)
            return []
        return self.perform(action)

    def perform(self, action: Action) -> list[Execution]:
        """Run what ``action`` needs that is not recorded yet (commands first, then webhooks)."""
        commands = [c for c in self.config.commands_for(action.kind) if (action.action_id, c.key()) not in self.done]
        hooks = [h for h in self.config.webhooks_for(action.kind) if (action.action_id, h.key()) not in self.done]
        if not commands and not hooks:
            planned = self.config.commands_for(action.kind) or self.config.webhooks_for(action.kind)
            self.ignored["duplicate" if planned else "no_rule"] += 1
            return []
        values: dict[str, str | None] = {}
        mapped = False
        if commands:
            target = self.config.target_for(action.run_id)
            mapped = target is not None
            # The platform's mapping, when it has the run, replaces what the run says about itself.
            meta = {} if mapped else (self._lookup_run(action.run_id) or {})
            values = placeholder_values(action, meta, self.config.vars, target)
        done: list[Execution] = []
        for command in commands:
            done.append(self._finish(action, self._run(action, command, values, mapped)))
        for hook in hooks:
            done.append(self._finish(action, self._post(action, hook, done)))
        return done

    def _run(self, action: Action, command: CommandTemplate, values: Mapping[str, str | None],
             mapped: bool) -> Execution:
        base = dict(action_id=action.action_id, run_id=action.run_id, kind=action.kind, target="command",
                    target_key=command.key())
        started = utc_now()
        rules = self.config.field_rules()
        try:
            argv = fill_argv(command.argv, values, rules)
        except RefusedValue as exc:
            return Execution(**base, status="refused", argv=list(command.argv), output=str(exc),
                             started_at=started, finished_at=utc_now())
        declared = [] if mapped else command.declared_fields()
        if command.verify is not None:
            problem = self._check_target(action, command.verify, values, rules, mapped)
            if problem is not None:
                status, output = problem
                return Execution(**base, status=status, argv=argv, output=output, started_at=started,
                                 finished_at=utc_now())
        elif declared:
            # Reachable only with a targets mapping that lacks this run (a config without one is refused).
            names = ", ".join("{" + n + "}" for n in declared)
            return Execution(**base, status="unverified", argv=argv, started_at=started, finished_at=utc_now(),
                             output=f"not run: {names} self-declared by the run, which is not in the targets "
                                    f"mapping, and the command has no verify")
        status, code, output = self._runner(argv, command.timeout_s)
        return Execution(**base, status=status, argv=argv, exit_code=code, output=output,
                         started_at=started, finished_at=utc_now())

    def _check_target(self, action: Action, verify: VerifyCommand, values: Mapping[str, str | None],
                      rules: Mapping[str, FieldRule], mapped: bool) -> tuple[str, str] | None:
        """``None`` if ``verify`` shows the target belongs to the run, else (status, reason)."""
        try:
            vargv = fill_argv(verify.argv, values, rules)
        except RefusedValue as exc:
            return "refused", f"verify not run: {exc}"
        shown = " ".join(vargv)
        if not mapped:
            # A verify command that echoes its target would "verify" a run named like the target.
            for name in argv_fields(verify.argv):
                if name in RUN_FIELDS and values.get(name) == action.run_id:
                    return "unverified", (f"not run: the run id equals its own declared {{{name}}}, so verify "
                                          f"`{shown}` cannot tell them apart; map the run in `targets`")
        status, code, stdout, stderr = self._verifier(vargv, verify.timeout_s)
        problem = verify_problem(action.run_id, status, code, stdout, stderr)
        if problem is None:
            return None
        if status == "timeout":
            problem += f" after {verify.timeout_s}s"
        return "unverified", _tail(f"not run: verify `{shown}` {problem}")

    def _post(self, action: Action, hook: Webhook, commands: list[Execution]) -> Execution:
        started = utc_now()
        status, code, output = self._poster(hook.url, slack_payload(action, commands), hook.timeout_s)
        return Execution(action_id=action.action_id, run_id=action.run_id, kind=action.kind, target="webhook",
                         target_key=hook.key(), status=status, url=hook.redacted_url(), exit_code=code,
                         output=output, started_at=started, finished_at=utc_now())

    def _finish(self, action: Action, execution: Execution) -> Execution:
        self._record(execution)
        self.done.add((execution.action_id, execution.target_key))
        self.executed[execution.status] += 1
        what = " ".join(execution.argv) if execution.target == "command" else execution.url
        log.log(logging.INFO if execution.status == "ok" else logging.WARNING,
                "remediate: %s %s for action %s (run %s, %s): %s%s%s", execution.target, what, action.action_id,
                action.run_id, action.kind, execution.status,
                "" if execution.exit_code is None else f" (exit {execution.exit_code})",
                f": {execution.output.strip()[-200:]}" if execution.status != "ok" and execution.output else "")
        return execution


# -- ClickHouse and Kafka at the edges -------------------------------------------------------------


class RemediationStore:
    """The ``remediations`` table and the run metadata lookup, on a ``ClickHouseSink``'s client."""

    def __init__(self, sink: Any):
        self.sink = sink

    def done_keys(self) -> set[tuple[str, str]]:
        rows = self.sink.query("SELECT DISTINCT action_id, target_key FROM {db}.remediations")
        return {(r[0], r[1]) for r in rows}

    def write(self, execution: Execution) -> None:
        row = list(execution.row())
        row[-2] = as_utc(row[-2])
        row[-1] = as_utc(row[-1])
        self.sink.client.insert(f"{self.sink.database}.remediations", [row], column_names=list(REMEDIATION_COLUMNS))

    def run_metadata(self, run_id: str) -> dict[str, Any]:
        rows = self.sink.query(
            "SELECT payload FROM {db}.telemetry WHERE run_id = %(r)s AND kind = 'run_start' "
            "ORDER BY ts DESC LIMIT 1", {"r": run_id})
        if not rows:
            return {}
        try:
            meta = orjson.loads(rows[0][0])
        except orjson.JSONDecodeError:
            return {}
        return meta if isinstance(meta, dict) else {}

    def executions(self, action_id: str) -> list[dict[str, Any]]:
        rows = self.sink.query(
            "SELECT " + ", ".join(REMEDIATION_COLUMNS) + " FROM {db}.remediations FINAL "
            "WHERE action_id = %(a)s ORDER BY started_at", {"a": action_id})
        return [dict(zip(REMEDIATION_COLUMNS, r, strict=True)) for r in rows]


class RemediateConsumer:
    """Consumes ``runwatch.actions`` in group ``runwatch-remediate`` until ``stopping`` is set;
    commits offsets only after what a batch needed is performed and recorded."""

    def __init__(
        self,
        config: RemediationConfig,
        secret: bytes,
        store: RemediationStore,
        bootstrap: str,
        *,
        group_id: str = REMEDIATE_GROUP,
        session_timeout_ms: int = 6000,
        runner: Callable[[list[str], float], tuple[str, int | None, str]] = run_command,
        poster: Callable[[str, dict[str, Any], float], tuple[str, int | None, str]] = post_webhook,
        verifier: Callable[[list[str], float], tuple[str, int | None, str, str]] = run_verify,
    ):
        self.store = store
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.session_timeout_ms = session_timeout_ms
        self.stopping = threading.Event()
        self.assigned = threading.Event()
        self.write_errors = 0
        self.commit_errors = 0
        self._meta: dict[str, Mapping[str, Any]] = {}
        self.remediator = Remediator(config, secret, record=self._record, lookup_run=self._lookup_run,
                                     done=store.done_keys(), runner=runner, poster=poster,
                                     verifier=verifier)

    def _lookup_run(self, run_id: str) -> Mapping[str, Any]:
        if run_id not in self._meta:
            try:
                meta = self.store.run_metadata(run_id)
            except Exception as exc:  # placeholders needing it are then refused, with the reason recorded
                log.warning("remediate: run_start lookup for %s failed: %s", run_id, exc)
                return {}
            if not meta:
                return {}  # not stored yet: ask again for the next action
            self._meta[run_id] = meta
        return self._meta[run_id]

    def _record(self, execution: Execution) -> None:
        # ClickHouse down: it ran, so keep trying to say so; never commit past it
        retry_durably(lambda: self.store.write(execution), stopping=self.stopping, errors=Exception,
                      on_error=self._record_failed)

    def _record_failed(self, exc: BaseException, delay: float) -> None:
        self.write_errors += 1
        log.warning("remediate: recording failed (%s); retrying in %.1fs", exc, delay)

    def _act(self, records: list) -> dict[tuple[str, int], int]:
        for record in records:
            self.remediator.handle(record.value)  # returns once its executions are recorded
        return {}

    def _commit_failed(self, _exc: Exception) -> None:
        self.commit_errors += 1  # recorded already; a re-delivery finds it done

    def run(self) -> None:
        consumer = make_consumer(self.bootstrap, [topics.ACTIONS], group_id=self.group_id,
                                 session_timeout_ms=self.session_timeout_ms, client_id="runwatch-remediate",
                                 fetch_max_wait_ms=100)
        ConsumeLoop(self._act, stopping=self.stopping, assigned=self.assigned, batch_size=100, drain=False,
                    label="remediate", on_commit_error=self._commit_failed).run(consumer)
