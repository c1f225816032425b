"""The remediator's core: what one delivered action needs, and doing it.

For every action the shared :class:`~runwatch.contract.inbox.ActionInbox` admits (it
decodes, checks the workers' Ed25519 signature with their public keys and the expiry, and refuses an
action whose every planned (action, target) pair is recorded already), it runs the command templates
of the rules that match the action's kind, as argument lists without a shell, and posts
Slack-compatible JSON to the webhooks that want that kind. I/O is injected: the consumer records to
ClickHouse, runs real programs and posts over HTTP; tests pass their own.

Targets: ``job_id``, ``host`` and ``pod`` are *self-declared*: they come from the trainer's own
``run_start`` (the worker copies them into the signed action's ``params``, so the signature
proves nothing about them). They are taken from the platform's ``targets`` mapping (inline or
``targets_file``) when it has the run, and then only from there; otherwise from the action's
``params``, else from the run's newest ``run_start`` in ClickHouse ``telemetry`` (field, then
tag). A command that uses a self-declared value runs only after its ``verify`` command (argv, no
shell, with a timeout, the same placeholders) exits 0 and prints the run id and nothing else on
each non-empty line of its stdout; otherwise it is recorded ``unverified`` and not run.

Idempotency: every execution is recorded (``record`` returns once it is stored); the (action,
target) pairs already recorded are loaded at start (``done``), and a pair that is recorded (ok,
failed, refused, unverified or timed out) is never run again, whether the action arrives twice or
the remediator restarted.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, TypedDict

from runwatch.contract.inbox import ActionInbox, Verdict
from runwatch.contract.schema import Action, utc_now
from runwatch.contract.signing import ActionPublicKeys
from runwatch.sinks.remediate.config import CommandTemplate, RemediationConfig, VerifyCommand, Webhook
from runwatch.sinks.remediate.notifications import post_webhook, slack_payload
from runwatch.sinks.remediate.record import Execution, tail
from runwatch.sinks.remediate.runner import run_command, run_verify, verify_problem
from runwatch.sinks.remediate.templates import (
    DECLARED_FIELDS,
    HOST_FIELDS,
    FieldRule,
    RefusedValue,
    argv_fields,
    fill_argv,
    placeholder_values,
)

log = logging.getLogger(__name__)


class _ExecutionKeys(TypedDict):
    """What every ``Execution`` of one action's command has in common."""

    action_id: str
    run_id: str
    kind: str
    target: str
    target_key: str


class Remediator:
    """Decides and performs what one delivered action needs; I/O is injected.

    ``record`` stores one execution (and must not return before it is stored);
    ``lookup_run`` gives a run's ``run_start`` fields; ``done`` is what is already recorded,
    as (action_id, target_key) pairs; ``runner`` runs a command, ``verifier`` a verify command;
    ``excluded`` gives the hosts a restart without its host leaves out, from the action's and the run's
    job's history (the hosts that keep failing: sinks/runwatch/sinks/hosts.py; by default the action's)."""

    def __init__(
        self,
        config: RemediationConfig,
        public_keys: ActionPublicKeys,
        *,
        record: Callable[[Execution], None] = lambda _e: None,
        lookup_run: Callable[[str], Mapping[str, Any]] = lambda _run: {},
        done: Iterable[tuple[str, str]] = (),
        runner: Callable[[list[str], float], tuple[str, int | None, str]] = run_command,
        poster: Callable[[str, dict[str, Any], float], tuple[str, int | None, str]] = post_webhook,
        verifier: Callable[[list[str], float], tuple[str, int | None, str, str]] = run_verify,
        now: Callable[[], datetime] = utc_now,
        excluded: Callable[[Action, Mapping[str, Any]], list[str]] | None = None,
    ):
        self.config = config
        self._excluded = excluded
        self._record = record
        self._lookup_run = lookup_run
        self._runner = runner
        self._verifier = verifier
        self._poster = poster
        self.done: set[tuple[str, str]] = set(done)
        # Every run's actions; what is recorded is the repeat check (per target, durable), not an id set.
        self.inbox = ActionInbox(public_keys, remember=False, handled=self._all_recorded, now=now)
        self.ignored = self.inbox.ignored  # the inbox's reasons, and no_rule
        self.executed: Counter[str] = Counter()  # by status

    def handle(self, raw: bytes | None) -> list[Execution]:
        """Everything done for one message from the action topic."""
        verdict = self.inbox.judge(raw)
        if verdict.reason is not None or verdict.action is None:
            _log_ignored(verdict)
            return []
        return self.perform(verdict.action)

    def _all_recorded(self, action: Action) -> str | None:
        """The inbox's repeat check: every (action, target) pair this action plans is recorded."""
        planned = [c.key() for c in self.config.commands_for(action.kind)]
        planned += [h.key() for h in self.config.webhooks_for(action.kind)]
        if planned and all((action.action_id, key) in self.done for key in planned):
            return "duplicate"
        return None

    def perform(self, action: Action) -> list[Execution]:
        """Run what ``action`` needs that is not recorded yet (commands first, then webhooks)."""
        commands = [
            c for c in self.config.commands_for(action.kind) if (action.action_id, c.key()) not in self.done
        ]
        hooks = [
            h for h in self.config.webhooks_for(action.kind) if (action.action_id, h.key()) not in self.done
        ]
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
            action = self._with_history(action, meta)
            values = placeholder_values(action, meta, self.config.vars, target)
        done: list[Execution] = []
        for command in commands:
            done.append(self._finish(action, self._run(action, command, values, mapped)))
        for hook in hooks:
            done.append(self._finish(action, self._post(action, hook, done)))
        return done

    def _with_history(self, action: Action, meta: Mapping[str, Any]) -> Action:
        """A restart without its host also leaves out the hosts its job's history names (the action's own
        first); its hosts are checked like the action's (templates.excluded_hosts), whoever named them."""
        if self._excluded is None or action.kind != "restart" or action.params.get("mode") != "exclude_host":
            return action
        try:
            hosts = self._excluded(action, meta)
        except Exception as exc:  # noqa: BLE001 - the history is a help: the restart goes on without it
            log.warning("remediate: the hosts of %s's history could not be read: %s", action.run_id, exc)
            return action
        return action.model_copy(update={"params": {**action.params, "exclude_hosts": hosts}})

    def _run(
        self, action: Action, command: CommandTemplate, values: Mapping[str, str | None], mapped: bool
    ) -> Execution:
        base: _ExecutionKeys = dict(
            action_id=action.action_id,
            run_id=action.run_id,
            kind=action.kind,
            target="command",
            target_key=command.key(),
        )
        started = utc_now()
        rules = self.config.field_rules()
        hosts = [name for name in argv_fields(command.argv) if name in HOST_FIELDS]
        if hosts and all(values.get(name) == "" for name in hosts):
            # (issue 39) a restart as it was: the command that leaves hosts out has none to leave out
            return Execution(
                **base,
                status="skipped",
                argv=list(command.argv),
                output="not run: the restart leaves no host out",
                started_at=started,
                finished_at=utc_now(),
            )
        try:
            argv = fill_argv(command.argv, values, rules)
        except RefusedValue as exc:
            return Execution(
                **base,
                status="refused",
                argv=list(command.argv),
                output=str(exc),
                started_at=started,
                finished_at=utc_now(),
            )
        declared = [] if mapped else command.declared_fields()
        if command.verify is not None:
            problem = self._check_target(action, command.verify, values, rules, mapped)
            if problem is not None:
                status, output = problem
                return Execution(
                    **base, status=status, argv=argv, output=output, started_at=started, finished_at=utc_now()
                )
        elif declared:
            # Reachable only with a targets mapping that lacks this run (a config without one is refused).
            names = ", ".join("{" + n + "}" for n in declared)
            return Execution(
                **base,
                status="unverified",
                argv=argv,
                started_at=started,
                finished_at=utc_now(),
                output=f"not run: {names} self-declared by the run, which is not in the targets "
                f"mapping, and the command has no verify",
            )
        status, code, output = self._runner(argv, command.timeout_s)
        return Execution(
            **base,
            status=status,
            argv=argv,
            exit_code=code,
            output=output,
            started_at=started,
            finished_at=utc_now(),
        )

    def _check_target(
        self,
        action: Action,
        verify: VerifyCommand,
        values: Mapping[str, str | None],
        rules: Mapping[str, FieldRule],
        mapped: bool,
    ) -> tuple[str, str] | None:
        """``None`` if ``verify`` shows the target belongs to the run, else (status, reason)."""
        try:
            vargv = fill_argv(verify.argv, values, rules)
        except RefusedValue as exc:
            return "refused", f"verify not run: {exc}"
        shown = " ".join(vargv)
        if not mapped:
            # A verify command that echoes its target would "verify" a run named like the target.
            for name in argv_fields(verify.argv):
                if name in DECLARED_FIELDS and values.get(name) == action.run_id:
                    return "unverified", (
                        f"not run: the run id equals its own declared {{{name}}}, so verify "
                        f"`{shown}` cannot tell them apart; map the run in `targets`"
                    )
        status, code, stdout, stderr = self._verifier(vargv, verify.timeout_s)
        problem = verify_problem(action.run_id, status, code, stdout, stderr)
        if problem is None:
            return None
        if status == "timeout":
            problem += f" after {verify.timeout_s}s"
        return "unverified", tail(f"not run: verify `{shown}` {problem}")

    def _post(self, action: Action, hook: Webhook, commands: list[Execution]) -> Execution:
        started = utc_now()
        status, code, output = self._poster(hook.url, slack_payload(action, commands), hook.timeout_s)
        return Execution(
            action_id=action.action_id,
            run_id=action.run_id,
            kind=action.kind,
            target="webhook",
            target_key=hook.key(),
            status=status,
            url=hook.redacted_url(),
            exit_code=code,
            output=output,
            started_at=started,
            finished_at=utc_now(),
        )

    def _finish(self, action: Action, execution: Execution) -> Execution:
        self._record(execution)
        self.done.add((execution.action_id, execution.target_key))
        self.executed[execution.status] += 1
        what = " ".join(execution.argv) if execution.target == "command" else execution.url
        log.log(
            logging.INFO if execution.status == "ok" else logging.WARNING,
            "remediate: %s %s for action %s (run %s, %s): %s%s%s",
            execution.target,
            what,
            action.action_id,
            action.run_id,
            action.kind,
            execution.status,
            "" if execution.exit_code is None else f" (exit {execution.exit_code})",
            f": {execution.output.strip()[-200:]}" if execution.status != "ok" and execution.output else "",
        )
        return execution


def _log_ignored(verdict: Verdict) -> None:
    action = verdict.action
    if verdict.reason == "malformed":
        log.warning("remediate: malformed action ignored (%s)", verdict.detail)
    elif verdict.reason == "bad_signature" and action is not None:
        log.warning(
            "remediate: action %s for run %s has a bad signature; ignored", action.action_id, action.run_id
        )
    elif verdict.reason == "expired" and action is not None:
        log.info("remediate: action %s expired at %s; ignored", action.action_id, action.expires_at)
