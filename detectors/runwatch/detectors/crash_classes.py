"""Stand-in crash classifier (issue 39): the signature helper A's rule table will have, with a handful of
obvious rules so the capture, the worker and the policy can be built and tested against it. Replaced
whole when the real classifier lands. Pure: no I/O, no clock."""

from __future__ import annotations

import re
from dataclasses import dataclass

CRASH_CLASSES: tuple[str, ...] = (
    "oom_host",
    "oom_device",
    "collective_timeout",
    "hardware",
    "segfault",
    "preemption",
    "dataloader",
    "nonfinite_stop",
    "user_code",
    "unknown",
)


@dataclass(frozen=True)
class CrashVerdict:
    crash_class: str
    rule: str
    evidence_line: str
    explanation: str


_OOM_HOST = re.compile(r"MemoryError|can't allocate memory|Cannot allocate memory", re.IGNORECASE)
_TRACEBACK = "Traceback (most recent call last)"


def _line(text: str, pattern: re.Pattern[str] | str) -> str | None:
    for line in text.splitlines():
        if (pattern.search(line) if isinstance(pattern, re.Pattern) else pattern in line) is not None and (
            not isinstance(pattern, str) or pattern in line
        ):
            return line.strip()[:512]
    return None


def classify(
    *, text: str, exception_type: str | None = None, signal: int | None = None, exit_code: int | None = None
) -> CrashVerdict:
    """The crash's class, the rule that decided it and the line it matched."""
    if exception_type == "MemoryError" or _OOM_HOST.search(text):
        line = _line(text, _OOM_HOST) or "MemoryError"
        return CrashVerdict("oom_host", "oom_host.memory_error", line, "the host ran out of memory")
    if signal == 11:
        return CrashVerdict("segfault", "segfault.signal", "signal 11", "the process died of SIGSEGV")
    if signal == 15:
        return CrashVerdict("preemption", "preemption.sigterm", "signal 15", "SIGTERM: the scheduler took it")
    if exception_type is not None or _TRACEBACK in text:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        found = next((ln for ln in reversed(lines) if exception_type and ln.startswith(exception_type)), None)
        line = found or (lines[-1][:512] if lines else str(exception_type))
        return CrashVerdict(
            "user_code", "user_code.traceback", line, "a Python exception in the training code"
        )
    evidence = f"signal {signal}" if signal is not None else f"exit code {exit_code}"
    return CrashVerdict("unknown", "unknown", evidence, "no rule matched")
