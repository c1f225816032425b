"""Argument templates and the values that may go into them.

A command is an argument list (no shell). Its program (``argv[0]``) is a literal; the other
arguments may hold ``{placeholders}`` whose values come only from an allow-list: the action's
fields (``ACTION_FIELDS``), the run's targets (``RUN_FIELDS``) and the config's own ``vars``.
Every filled-in value must full-match its field's pattern (``DEFAULT_FIELD_PATTERNS``, or the
config's ``fields``) and must not be empty, too long, or hold control characters; and unless the
field's rule names the hazard in ``allow``, it must not start with ``-`` or ``/``, contain
``://``, ``@``, ``..`` or whitespace (``HAZARDS``). A value that fails raises ``RefusedValue``:
the command is not run.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from runwatch.contract.schema import Action

if TYPE_CHECKING:
    from runwatch.sinks.remediate.targets import Target

ACTION_FIELDS = ("run_id", "action_id", "kind", "step", "onset_step", "target_step")
# Self-declared by the trainer (its run_start) unless the platform's targets mapping gives them.
RUN_FIELDS = ("job_id", "host", "pod")
# A restart's (issue 39): the crash's class, the restart's mode, and the hosts to leave out, as one
# comma-separated argument (`sbatch --exclude=`, Slurm's `ExcNodeList=`: options of the run's own job) and
# the first of them alone (`kubectl cordon`: the cluster's node, so a self-declared target that the
# command's verify must check, as a job id is). Each host passes the `host` rule, or the value is refused.
RESTART_FIELDS = ("crash_class", "restart_mode", "exclude_hosts", "exclude_host")
HOST_FIELDS = ("exclude_hosts", "exclude_host")  # empty for a restart as it was: their commands are skipped
DECLARED_FIELDS = RUN_FIELDS + ("exclude_host",)
ALLOWED_FIELDS = ACTION_FIELDS + RUN_FIELDS + RESTART_FIELDS
MAX_VALUE_LENGTH = 256  # no filled-in value is longer, whatever its pattern says

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
    "crash_class": r"^[a-z_]{1,32}$",
    "restart_mode": r"^(exclude_host|as_was)$",
    "exclude_hosts": r"^[A-Za-z0-9][A-Za-z0-9.-]{0,252}(,[A-Za-z0-9][A-Za-z0-9.-]{0,252})*$",
    "exclude_host": r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$",
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


DEFAULT_FIELD_RULES: dict[str, FieldRule] = {
    name: FieldRule(pattern=p) for name, p in DEFAULT_FIELD_PATTERNS.items()
}


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
            raise ValueError(
                f"placeholder {{{name}}} in {arg!r}: format specs and conversions are not allowed"
            )
        if not name.isidentifier():
            raise ValueError(f"placeholder {{{name}}} in {arg!r} is not a plain name")
        names.append(name)
    return names


def argv_fields(argv: list[str]) -> list[str]:
    """Placeholder names used anywhere in ``argv``, each once, in order."""
    return list(dict.fromkeys(name for arg in argv[1:] for name in template_fields(arg)))


def fill_argv(
    argv: list[str], values: Mapping[str, str | None], rules: Mapping[str, FieldRule] | None = None
) -> list[str]:
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


def check_argv_template(argv: list[str]) -> list[str]:
    if not argv[0] or template_fields(argv[0]) or "{" in argv[0] or "}" in argv[0]:
        raise ValueError("argv[0] (the program) must be a literal, non-empty name or path")
    for arg in argv[1:]:
        template_fields(arg)  # raises on a malformed template
    return argv


def placeholder_values(
    action: Action, run_meta: Mapping[str, Any], fixed: Mapping[str, str], target: Target | None = None
) -> dict[str, str | None]:
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
        declared_tags = run_meta.get("tags")
        tags: dict[str, Any] = declared_tags if isinstance(declared_tags, dict) else {}
        for name in RUN_FIELDS:
            value = action.params.get(name)
            if value is None:
                value = run_meta.get(name)
            if value is None:
                value = tags.get(name)
            # Only scalars become text; anything else is refused as unknown.
            values[name] = (
                str(value) if isinstance(value, str | int) and not isinstance(value, bool) else None
            )
    values.update(restart_values(action, rules=None, target=target))
    values.update(fixed)
    return values


def excluded_hosts(action: Action, rules: Mapping[str, FieldRule] | None = None) -> list[str] | None:
    """The hosts a restart leaves out (``params.exclude_hosts``), each checked by the ``host`` rule; None
    when any of them is not a host name (a forged one: the whole list is refused, never a part of it)."""
    hosts = action.params.get("exclude_hosts") or []
    if not isinstance(hosts, list):
        return None
    rule = (rules or DEFAULT_FIELD_RULES).get("host") or DEFAULT_FIELD_RULES["host"]
    out: list[str] = []
    for host in hosts:
        if not isinstance(host, str) or rule.reason(host) is not None:
            return None
        if host not in out:
            out.append(host)
    return out


def restart_values(
    action: Action, rules: Mapping[str, FieldRule] | None = None, target: Target | None = None
) -> dict[str, str | None]:
    """A restart's placeholders (``RESTART_FIELDS``); None where unknown or refused. With the platform's
    ``target`` naming the run's host, ``exclude_host`` must be that host."""
    if action.kind != "restart":
        return dict.fromkeys(RESTART_FIELDS)
    params = action.params
    crash_class, mode = params.get("crash_class"), params.get("mode")
    hosts = excluded_hosts(action, rules)
    first = hosts[0] if hosts else None
    if first is not None and target is not None and target.host is not None and first != target.host:
        first = None
    return {
        "crash_class": crash_class if isinstance(crash_class, str) else None,
        "restart_mode": mode if isinstance(mode, str) else None,
        "exclude_hosts": ",".join(hosts) if hosts else ("" if hosts == [] else None),
        "exclude_host": first if hosts else ("" if hosts == [] else None),
    }
