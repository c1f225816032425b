"""``run_end``'s status and summary: what a closed run says about how it ended.

An explicit status wins; otherwise ``stopped`` after an applied stop action (its id and cause
in the summary), else ``completed``. A ``with RunWatch(...)`` block that raised ends ``failed``
(``interrupted`` on Ctrl-C) with the exception's type and message.
"""

from __future__ import annotations

from typing import Any

_SUMMARY_TEXT = 500  # characters of an exception's message kept in run_end's summary


def truncate(text: str, limit: int = _SUMMARY_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def stop_record(action: Any) -> dict[str, str]:
    """What ``run_end`` says about an applied stop action: its id and cause (``params["cause"]``,
    else ``"stop"``)."""
    params = getattr(action, "params", None) or {}
    cause = params.get("cause") if isinstance(params, dict) else None
    return {
        "stop_action_id": str(getattr(action, "action_id", "") or ""),
        "stop_cause": truncate(str(cause)) if cause else "stop",
    }


def end_status(
    status: str | None, summary: dict[str, Any] | None, stopped_by: dict[str, str] | None
) -> tuple[str, dict[str, Any]]:
    """``run_end``'s status and summary: an explicit status wins; otherwise ``stopped`` after an
    applied stop (``stopped_by``, see :func:`stop_record`), else ``completed``."""
    if status is None:
        status = "stopped" if stopped_by else "completed"
    if status == "stopped" and stopped_by:
        summary = {**stopped_by, **(summary or {})}
    return status, dict(summary or {})


def exit_status(
    exc_type: type[BaseException] | None, exc: BaseException | None
) -> tuple[str | None, dict[str, Any]]:
    """``run_end``'s status for a ``with`` block that ended with ``exc`` (None: the usual rule)."""
    if exc_type is None or (issubclass(exc_type, SystemExit) and getattr(exc, "code", None) in (None, 0)):
        return None, {}
    summary = {"error_type": exc_type.__name__, "error": truncate(str(exc) if exc is not None else "")}
    if issubclass(exc_type, KeyboardInterrupt):
        return "interrupted", summary
    return "failed", summary
