"""``runwatch remediate``: run configured commands and post to webhooks for signed actions.

A separate consumer of ``runwatch.actions`` (group ``runwatch-remediate``). For every action
whose HMAC signature and expiry check out, it runs the command templates of the rules that
match the action's kind, as argument lists without a shell, and posts Slack-compatible JSON
to the webhooks that want that kind.

Safety: a template's placeholders come only from an allow-list (``ACTION_FIELDS``,
``RUN_FIELDS`` and the config's own ``vars``); each value must match ``SAFE_VALUE`` (no
spaces, no shell metacharacters, no leading ``-`` that a command would read as an option,
no ``..``) or the command is refused, not run. The program (``argv[0]``) is never a
placeholder, and the action secret is removed from the commands' environment.

Idempotency: every execution is a row in ClickHouse ``remediations``; on start the
(action, target) pairs already recorded are loaded, and a pair that is recorded (ok, failed,
refused or timed out) is never run again, whether the action arrives twice or the
remediator restarted. Kafka offsets are committed only after the rows are stored.

``job_id``, ``host`` and ``pod`` are taken from the action's signed ``params`` if present,
else from the run's newest ``run_start`` event in ClickHouse ``telemetry`` (as written by
``runwatch sink`` to the same ClickHouse): its field of that name, else its tag of that name.
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
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runwatch.configfile import ConfigError as ConfigError  # re-exported: callers catch it from here
from runwatch.configfile import load_yaml_model
from runwatch.producer import topics
from runwatch.producer.schema import Action, ActionKind, SchemaError, decode_action, utc_now
from runwatch.producer.signing import verify_action

log = logging.getLogger(__name__)

REMEDIATE_GROUP = "runwatch-remediate"

# A filled-in value: letters, digits and . _ : / @ -, 1..200 characters, not starting with "-".
SAFE_VALUE = re.compile(r"[A-Za-z0-9._:/@][A-Za-z0-9._:/@-]{0,199}")
ACTION_FIELDS = ("run_id", "action_id", "kind", "step", "onset_step", "target_step")
RUN_FIELDS = ("job_id", "host", "pod")
ALLOWED_FIELDS = ACTION_FIELDS + RUN_FIELDS
OUTPUT_LIMIT = 4000  # characters of a command's output (its tail) or a webhook's response kept

STATUSES = ("ok", "failed", "refused", "timeout")


class RefusedValue(ValueError):
    """A placeholder whose value is missing or unsafe: the command is not run."""


def unsafe_reason(value: str) -> str | None:
    """Why ``value`` may not go into a command line, or ``None`` if it may."""
    if not SAFE_VALUE.fullmatch(value):
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


def fill_argv(argv: list[str], values: Mapping[str, str | None]) -> list[str]:
    """The argument list with placeholders replaced; raises ``RefusedValue`` if any value is
    missing or unsafe (checked per value, so literal text in the template may be anything)."""
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
            reason = unsafe_reason(value)
            if reason:
                raise RefusedValue(f"{{{name}}} = {value[:60]!r} {reason}")
            parts.append(value)
        out.append("".join(parts))
    return out


# -- configuration -------------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CommandTemplate(Strict):
    argv: list[str] = Field(min_length=1, description="program and arguments; {placeholders} allowed after argv[0]")
    timeout_s: float = Field(default=60.0, gt=0, le=3600)

    @field_validator("argv")
    @classmethod
    def _check_argv(cls, argv: list[str]) -> list[str]:
        if not argv[0] or template_fields(argv[0]) or "{" in argv[0] or "}" in argv[0]:
            raise ValueError("argv[0] (the program) must be a literal, non-empty name or path")
        for arg in argv[1:]:
            template_fields(arg)  # raises on a malformed template
        return argv

    def key(self) -> str:
        return "command:" + hashlib.sha1(orjson.dumps(self.argv)).hexdigest()[:16]


class Rule(Strict):
    kinds: list[ActionKind] = Field(min_length=1)
    commands: list[CommandTemplate] = Field(min_length=1)


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
    rules: list[Rule] = Field(default_factory=list)
    webhooks: list[Webhook] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_placeholders(self) -> RemediationConfig:
        for name, value in self.vars.items():
            if not name.isidentifier() or name in ALLOWED_FIELDS:
                raise ValueError(f"vars.{name}: must be a plain name other than {', '.join(ALLOWED_FIELDS)}")
            reason = unsafe_reason(value)
            if reason:
                raise ValueError(f"vars.{name} = {value!r} {reason}")
        allowed = set(ALLOWED_FIELDS) | set(self.vars)
        for rule in self.rules:
            for command in rule.commands:
                for arg in command.argv[1:]:
                    for name in template_fields(arg):
                        if name not in allowed:
                            raise ValueError(
                                f"{{{name}}} in {command.argv}: allowed placeholders are "
                                f"{', '.join(sorted(allowed))}")
        return self

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


def placeholder_values(action: Action, run_meta: Mapping[str, Any], fixed: Mapping[str, str]) -> dict[str, str | None]:
    """Every allowed placeholder's value for ``action`` (``None`` where unknown)."""
    target = action.target_checkpoint
    values: dict[str, str | None] = {
        "run_id": action.run_id,
        "action_id": action.action_id,
        "kind": action.kind,
        "step": None if action.step is None else str(action.step),
        "onset_step": None if action.onset_step is None else str(action.onset_step),
        "target_step": None if target is None else str(target.step),
    }
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
    status: str  # ok | failed | refused | timeout
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


def run_command(argv: list[str], timeout_s: float) -> tuple[str, int | None, str]:
    """Run ``argv`` without a shell; returns (status, exit code, output tail)."""
    try:
        proc = subprocess.Popen(argv, shell=False, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
    except OSError as exc:
        return "failed", None, f"could not start {argv[0]!r}: {exc.strerror or exc}"
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Its own session: kill the whole group, so a grandchild holding the pipe cannot hang us.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out = b""
        return "timeout", proc.returncode, _tail(out.decode(errors="replace")) + f"\n[killed after {timeout_s}s]"
    status = "ok" if proc.returncode == 0 else "failed"
    return status, proc.returncode, _tail(out.decode(errors="replace"))


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
    as (action_id, target_key) pairs."""

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
        now: Callable[[], datetime] = utc_now,
    ):
        self.config = config
        self._secret = secret
        self._record = record
        self._lookup_run = lookup_run
        self._runner = runner
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
        if commands:
            values = placeholder_values(action, self._lookup_run(action.run_id) or {}, self.config.vars)
        done: list[Execution] = []
        for command in commands:
            done.append(self._finish(action, self._run(action, command, values)))
        for hook in hooks:
            done.append(self._finish(action, self._post(action, hook, done)))
        return done

    def _run(self, action: Action, command: CommandTemplate, values: Mapping[str, str | None]) -> Execution:
        base = dict(action_id=action.action_id, run_id=action.run_id, kind=action.kind, target="command",
                    target_key=command.key())
        started = utc_now()
        try:
            argv = fill_argv(command.argv, values)
        except RefusedValue as exc:
            return Execution(**base, status="refused", argv=list(command.argv), output=str(exc),
                             started_at=started, finished_at=utc_now())
        status, code, output = self._runner(argv, command.timeout_s)
        return Execution(**base, status=status, argv=argv, exit_code=code, output=output,
                         started_at=started, finished_at=utc_now())

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
        row[-2] = _utc(row[-2])
        row[-1] = _utc(row[-1])
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


def _utc(ts: datetime) -> datetime:
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


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
                                     done=store.done_keys(), runner=runner, poster=poster)

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
        delay = 0.5
        while True:
            try:
                self.store.write(execution)
                return
            except Exception as exc:  # ClickHouse down: it ran, so keep trying to say so; never commit past it
                self.write_errors += 1
                log.warning("remediate: recording failed (%s); retrying in %.1fs", exc, delay)
                if self.stopping.wait(delay):
                    raise
                delay = min(delay * 2, 10.0)

    def run(self) -> None:
        from kafka import KafkaConsumer

        consumer = KafkaConsumer(
            topics.ACTIONS,
            bootstrap_servers=self.bootstrap,
            api_version=topics.KAFKA_API_VERSION,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=self.session_timeout_ms,
            heartbeat_interval_ms=1000,
            fetch_max_wait_ms=100,
            client_id="runwatch-remediate",
        )
        try:
            while not self.stopping.is_set():
                polled = consumer.poll(timeout_ms=100, max_records=100)
                if consumer.assignment():
                    self.assigned.set()
                records = [r for batch in polled.values() for r in batch]
                if not records:
                    continue
                for record in records:
                    self.remediator.handle(record.value)
                try:
                    consumer.commit()
                except Exception as exc:  # recorded already; a re-delivery finds it done
                    self.commit_errors += 1
                    log.warning("remediate: offset commit failed (%r); carrying on", exc)
        finally:
            consumer.close()

