"""Notifications: the Slack-compatible payload for an action (and the commands run for it) and
posting it to a webhook."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

import orjson

from runwatch.contract.action_kinds import ACTION_KINDS
from runwatch.contract.logsafe import escape_control
from runwatch.contract.schema import Action
from runwatch.sinks.remediate.record import OUTPUT_LIMIT, Execution, tail


def _slack_escape(text: str) -> str:
    """Slack's three markup characters, and anything unprintable (a newline in a name) as its escape."""
    return escape_control(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


COLORS = {name: spec.chat_color for name, spec in ACTION_KINDS.items()}


def _figure(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "n/a" if value is None else _slack_escape(str(value))
    return f"{value:.4g}"


def outlier_alert_text(action: Action, baseline: dict[str, Any]) -> str:
    """The "outlier alert (30-day)" of a run that ended with summary metrics outside its job's
    history: one line per metric with the last value, the window's median and the verdict."""
    days = baseline.get("window_days", 30)
    days_text = f"{days:g}" if isinstance(days, int | float) else "30"
    key = _slack_escape(str(baseline.get("baseline_key") or "?"))
    commit = baseline.get("git_sha")
    head = (
        f"runwatch *outlier alert ({days_text}-day)* for baseline `{key}`: run "
        f"`{_slack_escape(action.run_id)}`"
        + (f" at commit `{_slack_escape(str(commit)[:12])}`" if commit else "")
    )
    since = baseline.get("last_normal_sha")
    if since and commit:
        head += f" (last normal run at `{_slack_escape(str(since)[:12])}`)"
    lines = [head]
    rows = baseline.get("rows")
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        lines.append(
            f"• {_slack_escape(str(row.get('metric')))}: last {_figure(row.get('last'))}, "
            f"{days_text}-day median {_figure(row.get('median'))} (n={_figure(row.get('n'))}): "
            f"*{_slack_escape(str(row.get('verdict')))}*"
        )
    return "\n".join(lines)


def slack_payload(action: Action, commands: Iterable[Execution] = ()) -> dict[str, Any]:
    """Slack-compatible JSON: ``text`` and an attachment with fields, plus the action itself
    (without its signature) under ``runwatch`` for machines. An alert about a run's summary against
    its job's history (``params.baseline``) reads as an outlier alert, one line per metric."""
    step = f" at step {action.step}" if action.step is not None else ""
    text = (
        f"runwatch *{action.kind}* for run `{_slack_escape(action.run_id)}`{step}: "
        f"{_slack_escape(action.reason)}"
    )
    baseline = action.params.get("baseline")
    if isinstance(baseline, dict):
        text = outlier_alert_text(action, baseline)
    fields = [
        {"title": "run_id", "value": _slack_escape(action.run_id), "short": True},
        {"title": "kind", "value": action.kind, "short": True},
        {"title": "action_id", "value": _slack_escape(action.action_id), "short": True},
    ]
    if action.step is not None:
        fields.append({"title": "step", "value": str(action.step), "short": True})
    if action.target_checkpoint is not None:
        fields.append(
            {"title": "target checkpoint", "value": f"step {action.target_checkpoint.step}", "short": True}
        )
    for ex in commands:
        fields.append(
            {
                "title": "command",
                "value": f"`{_slack_escape(' '.join(ex.argv))}`: {ex.status}"
                + ("" if ex.exit_code is None else f" (exit {ex.exit_code})"),
                "short": False,
            }
        )
    body = orjson.loads(action.model_dump_json(exclude={"signature"}, exclude_none=True))
    return {
        "text": text,
        "attachments": [{"color": COLORS.get(action.kind, "warning"), "fallback": text, "fields": fields}],
        "runwatch": body,
    }


def post_webhook(url: str, payload: dict[str, Any], timeout_s: float) -> tuple[str, int | None, str]:
    """POST ``payload`` as JSON; returns (status, HTTP status, response body tail)."""
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "runwatch"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # the config allows http(s) only
            body = response.read(OUTPUT_LIMIT).decode(errors="replace")
            return ("ok" if 200 <= response.status < 300 else "failed"), response.status, body
    except urllib.error.HTTPError as exc:
        return "failed", exc.code, tail(exc.read(OUTPUT_LIMIT).decode(errors="replace"))
    except TimeoutError:
        return "timeout", None, f"no answer within {timeout_s}s"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return ("timeout" if isinstance(reason, TimeoutError) else "failed"), None, str(reason)[:OUTPUT_LIMIT]
