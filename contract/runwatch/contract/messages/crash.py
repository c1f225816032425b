"""A rank's last words (``kind`` ``crash``) and the bounds that cut them (``bound_crash``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from runwatch.contract.messages.base import ELLIPSIS, EventBase

CrashSource = Literal["exception", "thread_exception", "signal", "fatal_signal", "launcher"]
# A crash report's strings, in characters: the traceback and the log tail keep their end (the last lines
# say what killed it), the rest their head; what is cut is marked and ``truncated`` set, never refused.
CRASH_TEXT_CHARS = 16_384  # traceback, log_tail
CRASH_MESSAGE_CHARS = 4096
CRASH_NAME_CHARS = 256  # exception_type, host, thread


class CrashEvent(EventBase):
    """A rank's last words (``kind`` ``crash``): facts, never a class (a trainer is untrusted; the worker
    classifies them, detectors/runwatch/detectors/crash_classes.py). ``source``: who said it: the process's
    ``sys.excepthook`` (``exception``) or ``threading.excepthook`` (``thread_exception``), its SIGTERM
    handler (``signal``), or ``runwatch launch``, the supervisor that saw it die (``launcher``: the exit
    code or the signal, the faulthandler file of a fatal signal, the tail of its output). ``step``: the last
    completed step. Bounded by ``bound_crash``."""

    kind: Literal["crash"] = "crash"
    step: int | None = Field(default=None, ge=0)
    source: CrashSource = "exception"
    exception_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    signal: int | None = Field(default=None, ge=1, le=128)
    exit_code: int | None = Field(default=None, ge=-(2**31), le=2**31)
    host: str | None = None
    log_tail: str | None = None
    # The thread whose exception it was (``thread_exception``: ``threading.excepthook``'s thread name)
    thread: str | None = None
    truncated: bool = False


def clip_keep_end(text: str, limit: int, what: str) -> str:
    """``text`` within ``limit`` characters, its end kept and the cut marked at its start."""
    if len(text) <= limit:
        return text
    mark = f"[{what} truncated: the first {{}} of {len(text)} characters cut]\n"
    cut = len(text) - (limit - len(mark) - 12)
    return mark.format(cut) + text[cut:]


def clip_keep_head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def bound_crash(event: CrashEvent) -> CrashEvent:
    """``event`` within the crash bounds (``CRASH_*_CHARS``), what was cut marked (``truncated``) and only
    its known fields kept when it was cut; ``event`` itself when nothing needs cutting."""
    update: dict[str, Any] = {}
    for name in ("traceback", "log_tail"):
        value = getattr(event, name)
        if value is not None and len(value) > CRASH_TEXT_CHARS:
            update[name] = clip_keep_end(value, CRASH_TEXT_CHARS, name)
    for name, limit in (("message", CRASH_MESSAGE_CHARS), ("exception_type", CRASH_NAME_CHARS)):
        value = getattr(event, name)
        if value is not None and len(value) > limit:
            update[name] = clip_keep_head(value, limit)
    for name in ("host", "thread"):
        value = getattr(event, name)
        if value is not None and len(value) > CRASH_NAME_CHARS:
            update[name] = clip_keep_head(value, CRASH_NAME_CHARS)
    if not update:
        return event
    known = {name: getattr(event, name) for name in CrashEvent.model_fields}
    return CrashEvent.model_construct(**{**known, **update, "truncated": True})
