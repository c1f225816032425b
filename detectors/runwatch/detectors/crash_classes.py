"""What a crash was: ordered, explainable rules over the last words of a dead training process.

The worker calls :func:`classify` with everything the crash said (the exception and its traceback, a
fatal signal's dump, the tail of the log the launcher passed) and what a launcher knows for certain
(the signal that ended the process, its exit code, the exception type an ``excepthook`` saw). The
rules run in order and the first that matches decides; each has an id, and the verdict carries the
line it matched, so a person can check it (the rules are crash_rules.py's; docs/crashes.md lists every
rule in this order and why).

The input is untrusted (trainers, and whatever their logs quote): the work is bounded (the first
16 KiB and the last 64 KiB are scanned, each line cut to 4 KiB, and every pattern is free of nested
repetition, so no input backtracks catastrophically), nothing in it is ever evaluated, and the
evidence line comes back as plain text with control and formatting characters escaped. Pure: no I/O,
no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runwatch.detectors.crash_rules import CRASH_CLASSES, RULES, CrashRule

__all__ = ["CRASH_CLASSES", "RULES", "CrashVerdict", "classify", "sanitize"]

HEAD_CHARS = 16 * 1024  # the start of a log: a crash that logs its cause early, then hangs in teardown
TAIL_CHARS = 64 * 1024  # the end: where the last words are
LINE_CHARS = 4 * 1024  # one line, for matching (a JSON log may hold a whole traceback on one line)
EVIDENCE_CHARS = 300
EXCEPTION_TYPE_CHARS = 200

# Linux numbering: launchers report the number the kernel gave them.
SIGNAL_NAMES = {
    1: "SIGHUP",
    2: "SIGINT",
    3: "SIGQUIT",
    4: "SIGILL",
    5: "SIGTRAP",
    6: "SIGABRT",
    7: "SIGBUS",
    8: "SIGFPE",
    9: "SIGKILL",
    10: "SIGUSR1",
    11: "SIGSEGV",
    12: "SIGUSR2",
    13: "SIGPIPE",
    14: "SIGALRM",
    15: "SIGTERM",
}


@dataclass(frozen=True)
class CrashVerdict:
    """The class of a crash, the id of the rule that decided it, the line (or signal) it matched,
    and one sentence saying why."""

    crash_class: str
    rule: str
    evidence_line: str
    explanation: str


@dataclass(frozen=True)
class _Facts:
    """What one crash said, bounded: the scanned text, and what the launcher knew."""

    text: str
    exception_type: str | None
    signal: int | None  # the signal that ended the process, from the launcher or its exit code
    signal_source: str  # "signal", "exit code N" or "" (none known)
    exit_code: int | None = None


# The launcher-side wrappers of a child's failure: their traceback is the launcher's, not the code's.
_WRAPPER_EXCEPTIONS = re.compile(r"(?:\w{1,40}\.){0,6}(?:ChildFailedError|CalledProcessError)")
_TRACEBACK = re.compile(
    r"^(?P<prefix>(?:\[(?:rank|default)\d{1,6}\]: ?|\d{1,6}: )?)Traceback \(most recent call last\):",
    re.MULTILINE,
)
# An exception line: a dotted name, then ':' or the end of the line, at the prefix's indentation.
_EXCEPTION_LINE = re.compile(r"(?P<name>[A-Za-z_][\w]{0,80}(?:\.[A-Za-z_][\w]{0,80}){0,8})(?::|$)")
_LINE_PREFIX = re.compile(r"(?:\[(?:rank|default)\d{1,6}\]:|\d{1,6}: )")
_TEXT_SIGNAL = (
    re.compile(r"\bexitcode\s{0,4}:\s{0,4}-(?P<n>\d{1,2})\b"),  # torchrun's ChildFailedError summary
    re.compile(r"\bSignal (?P<n>\d{1,2}) \(SIG[A-Z0-9]{1,8}\) received by PID\b"),
)


def classify(
    *,
    text: str,
    exception_type: str | None = None,
    signal: int | None = None,
    exit_code: int | None = None,
) -> CrashVerdict:
    """The class of a crash from what it said (``text``: the exception message, traceback and log tail,
    joined by newlines) and what its launcher knew. Never raises on any string; bounded work."""
    facts = _facts(text, exception_type, signal, exit_code)
    for rule in RULES:
        verdict = _apply(rule, facts)
        if verdict is not None:
            return verdict
    return CrashVerdict(
        "unknown",
        "no_rule",
        _signal_evidence(facts)
        or _last_line(facts.text)
        or (f"exit code {facts.exit_code}" if facts.exit_code is not None else "nothing was said"),
        "Nothing the crash said matches a rule: restart it as it was once, and look at its log.",
    )


def _facts(text: str, exception_type: str | None, signal: int | None, exit_code: int | None) -> _Facts:
    scanned = _bounded(text if isinstance(text, str) else "")
    etype = exception_type.strip()[:EXCEPTION_TYPE_CHARS] if isinstance(exception_type, str) else None
    source = ""
    sig: int | None = None
    if isinstance(signal, int) and 0 < signal < 65:
        sig, source = signal, "signal"
    elif isinstance(exit_code, int) and 128 < exit_code <= 128 + 64:
        sig, source = exit_code - 128, f"exit code {exit_code}"  # a shell's 128 + N
    elif isinstance(exit_code, int) and -65 < exit_code < 0:
        sig, source = -exit_code, f"exit code {exit_code}"  # Python's subprocess: -N
    code = exit_code if isinstance(exit_code, int) and -(2**31) <= exit_code < 2**32 else None
    return _Facts(scanned, etype or None, sig, source, code)


def _bounded(text: str) -> str:
    """The head and the tail of ``text``, each line cut to :data:`LINE_CHARS`."""
    if len(text) > HEAD_CHARS + TAIL_CHARS:
        text = text[:HEAD_CHARS] + "\n" + text[-TAIL_CHARS:]
    if len(text) > LINE_CHARS and any(len(line) > LINE_CHARS for line in text.split("\n")):
        text = "\n".join(line[:LINE_CHARS] for line in text.split("\n"))
    return text


def _apply(rule: CrashRule, facts: _Facts) -> CrashVerdict | None:
    if rule.id == "python_exception":
        return _python_exception(rule, facts)
    if rule.pattern is not None and (not rule.only_signals or facts.signal in rule.only_signals):
        found = _last_match(rule, facts.text)
        if found is not None:
            match, line = found
            return CrashVerdict(rule.crash_class, rule.id, line, _explain(rule, match))
    if rule.exception is not None and facts.exception_type and rule.exception.fullmatch(facts.exception_type):
        return CrashVerdict(
            rule.crash_class, rule.id, sanitize(f"exception {facts.exception_type}"), _explain(rule, None)
        )
    if rule.signals and facts.signal in rule.signals:
        return CrashVerdict(rule.crash_class, rule.id, _signal_evidence(facts), _explain(rule, None, facts))
    if rule.signals and facts.signal is None:
        text_signal = _text_signal(facts.text)
        if text_signal is not None and text_signal[0] in rule.signals:
            sig, line = text_signal
            return CrashVerdict(
                rule.crash_class, rule.id, line, _explain(rule, None, _Facts("", None, sig, "log"))
            )
    return None


def _last_match(rule: CrashRule, text: str) -> tuple[re.Match[str], str] | None:
    """The last accepted match of the rule's pattern (the nearest to the process's end), and its line."""
    assert rule.pattern is not None
    last: tuple[re.Match[str], str] | None = None
    for match in rule.pattern.finditer(text):
        if rule.accept is not None and not rule.accept(match):
            continue
        line = _line_at(text, match.start())
        if rule.unless is not None and rule.unless.search(line):
            continue
        last = (match, line)
    if last is None:
        return None
    return last[0], sanitize(last[1])


def _explain(rule: CrashRule, match: re.Match[str] | None, facts: _Facts | None = None) -> str:
    if "{code}" not in rule.explanation:
        return rule.explanation
    code = ""
    if match is not None:
        code = next((g for g in match.groups() if g and g.isdigit()), "")
    elif facts is not None and facts.signal is not None:
        code = SIGNAL_NAMES.get(facts.signal, f"signal {facts.signal}")
        if facts.signal_source.startswith("exit code"):
            code += f", read from its {facts.signal_source}"
        elif facts.signal_source == "log":
            code += ", named in its launcher's log"
    return rule.explanation.replace("{code}", code)


def _python_exception(rule: CrashRule, facts: _Facts) -> CrashVerdict | None:
    """The last traceback's exception (a launcher's wrapper of a child's failure does not count), or the
    exception type the excepthook saw."""
    line = _last_exception_line(facts.text)
    if line is not None:
        return CrashVerdict(rule.crash_class, rule.id, line, rule.explanation)
    if facts.exception_type and not _WRAPPER_EXCEPTIONS.fullmatch(facts.exception_type):
        return CrashVerdict(
            rule.crash_class, rule.id, sanitize(f"exception {facts.exception_type}"), rule.explanation
        )
    return None


def _last_exception_line(text: str) -> str | None:
    """The exception line that ends the last traceback that is not a launcher's wrapper."""
    found: str | None = None
    for header in _TRACEBACK.finditer(text):
        prefix = header.group("prefix")
        end = text.find("\n", header.end())
        # The exception line: the first line after the header, in the same prefix, not indented.
        for candidate in text[end + 1 : end + 1 + 32 * 1024].split("\n")[:400] if end >= 0 else []:
            body = candidate[len(prefix) :] if prefix and candidate.startswith(prefix) else candidate
            if prefix and not candidate.startswith(prefix):
                continue  # another rank's interleaved line
            if not body or body[0] in " \t":
                continue
            match = _EXCEPTION_LINE.match(body)
            if match is None:
                break
            if not _WRAPPER_EXCEPTIONS.fullmatch(match.group("name")):
                found = sanitize(candidate)
            break
    return found


def _text_signal(text: str) -> tuple[int, str] | None:
    """A signal a launcher's own log names (torchrun's ``exitcode: -11``), and its line."""
    for pattern in _TEXT_SIGNAL:
        last = None
        for match in pattern.finditer(text):
            last = match
        if last is not None:
            return int(last.group("n")), sanitize(_line_at(text, last.start()))
    return None


def _signal_evidence(facts: _Facts) -> str:
    if facts.signal is None:
        return ""
    name = SIGNAL_NAMES.get(facts.signal)
    evidence = f"signal {facts.signal}" + (f" ({name})" if name else "")
    return evidence + (f", from {facts.signal_source}" if facts.signal_source.startswith("exit code") else "")


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end >= 0 else len(text)]


def _last_line(text: str) -> str:
    for line in reversed(text[-8192:].split("\n")):
        if line.strip():
            return sanitize(line)
    return ""


_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\t\n]")


def sanitize(line: str) -> str:
    """``line`` as plain text for a finding: control and bidi/format characters escaped (``\\x1b``,
    ``\\u202e``: a terminal or a page shows them, never acts on them), stripped, cut to
    :data:`EVIDENCE_CHARS` characters with a mark."""
    line = line.strip()[: EVIDENCE_CHARS * 2]
    escaped = _UNSAFE.sub(lambda m: _escape(m.group()), line)
    if len(escaped) > EVIDENCE_CHARS:
        escaped = escaped[: EVIDENCE_CHARS - 3].rstrip("\\") + "..."
    return escaped


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
